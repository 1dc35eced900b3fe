"""Security checks on the source tree: no unsafe unpickling, localhost-bound cluster configs, no shell.

These are static scans (AST for Python, text for cluster configs). Each scanner is first run on a
known-bad snippet, so a scanner that silently matches nothing fails its own test.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "eagle3_ray"
CLUSTER = ROOT / "cluster"
JOBS = ROOT / "jobs"

# Loaders that run arbitrary code from the bytes they read unless restricted.
_UNPICKLERS = {("pickle", "load"), ("pickle", "loads"), ("pickle", "Unpickler"), ("cPickle", "load"),
               ("cPickle", "loads"), ("dill", "load"), ("dill", "loads"), ("joblib", "load"),
               ("cloudpickle", "load"), ("cloudpickle", "loads")}
_LOCALHOST = {"127.0.0.1", "localhost", "::1", "[::1]"}
# A config binding a public address must say how access is protected.
_AUTH_NOTE = re.compile(r"auth|token|tls|mtls|ssh -L|port-forward|kubectl port-forward|firewall|private network",
                        re.IGNORECASE)
_BIND_KEYS = re.compile(
    r"(dashboard[-_]host|dashboard[-_]agent[-_]listen[-_]host|ray[-_]client[-_]server[-_]host|node[-_]ip[-_]address"
    r"|--host)\s*[:=]?\s*[\"']?([0-9A-Za-z.:\[\]-]+)",
    re.IGNORECASE,
)


def _dotted(node: ast.AST) -> tuple[str, ...]:
    """`a.b.c` -> ("a", "b", "c"); anything else -> ()."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return tuple(reversed(parts))
    return ()


def _kwarg(call: ast.Call, name: str) -> ast.AST | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


def _is_true(node: ast.AST | None) -> bool:
    return isinstance(node, ast.Constant) and node.value is True


def unsafe_loads(source: str, filename: str = "<src>") -> list[str]:
    """Calls that unpickle untrusted bytes: pickle & co, torch.load without weights_only=True,
    numpy.load(allow_pickle=True), yaml.load without a safe loader."""
    found = []
    imported_as: dict[str, str] = {}  # `from pickle import load as l` -> {"l": "pickle.load"}
    tree = ast.parse(source, filename)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            for a in node.names:
                imported_as[a.asname or a.name] = f"{node.module}.{a.name}"
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = _dotted(node.func)
        if len(name) == 1 and name[0] in imported_as:
            name = tuple(imported_as[name[0]].split("."))
        if not name:
            continue
        where = f"{filename}:{node.lineno}: {'.'.join(name)}"
        if tuple(name[-2:]) in _UNPICKLERS:
            found.append(where)
        elif name[-2:] == ("torch", "load") and not _is_true(_kwarg(node, "weights_only")):
            found.append(where + " without weights_only=True")
        elif name[-2:] in (("np", "load"), ("numpy", "load")) and _is_true(_kwarg(node, "allow_pickle")):
            found.append(where + " with allow_pickle=True")
        elif name[-2:] == ("yaml", "load"):
            loader = _kwarg(node, "Loader") or (node.args[1] if len(node.args) > 1 else None)
            if not (loader is not None and "Safe" in ".".join(_dotted(loader))):
                found.append(where + " without a SafeLoader")
    return found


def shell_calls(source: str, filename: str = "<src>") -> list[str]:
    """Calls that hand a string to a shell: shell=True anywhere, os.system/os.popen, eval/exec."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if not isinstance(node, ast.Call):
            continue
        name = ".".join(_dotted(node.func))
        where = f"{filename}:{node.lineno}: {name or '<call>'}"
        if _is_true(_kwarg(node, "shell")):
            found.append(where + "(shell=True)")
        elif name in ("os.system", "os.popen", "subprocess.getoutput", "subprocess.getstatusoutput",
                      "eval", "exec", "commands.getoutput"):
            found.append(where)
    return found


def _py_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.py") if "__pycache__" not in p.parts)


def _scan(root: Path, scanner) -> list[str]:
    hits = []
    for p in _py_files(root):
        hits += scanner(p.read_text(encoding="utf-8"), str(p.relative_to(ROOT)))
    return hits


def public_binds(text: str) -> list[str]:
    """Host settings in a cluster file that bind beyond localhost."""
    return [f"{m.group(1)}={m.group(2)}" for m in _BIND_KEYS.finditer(text) if m.group(2) not in _LOCALHOST]


# ---------------------------------------------------------------- the scanners catch what they must


def test_unpickling_scanner_flags_every_unsafe_form():
    bad = """
import pickle, torch, yaml, numpy as np
from pickle import loads as l
pickle.load(open("x", "rb"))
l(b"")
torch.load("ckpt.pt")
torch.load("ckpt.pt", weights_only=False)
np.load("a.npy", allow_pickle=True)
yaml.load(open("c.yaml"))
"""
    good = """
import torch, yaml, numpy as np
torch.load("ckpt.pt", weights_only=True, map_location="cpu")
np.load("a.npy")
yaml.load(open("c.yaml"), Loader=yaml.SafeLoader)
yaml.safe_load("a: 1")
"""
    assert len(unsafe_loads(bad)) == 6
    assert unsafe_loads(good) == []


def test_shell_scanner_flags_every_shell_form():
    bad = """
import os, subprocess
subprocess.run(f"ray job submit {user}", shell=True)
subprocess.Popen(cmd, shell=True)
os.system("ls " + path)
os.popen("id")
eval(expr)
"""
    good = """
import subprocess, sys
subprocess.run([sys.executable, "-m", "eagle3_ray.cli", "run", "-c", config], check=True)
"""
    assert len(shell_calls(bad)) == 5
    assert shell_calls(good) == []


def test_bind_scanner_flags_public_addresses():
    text = "ray start --head --dashboard-host=0.0.0.0\nrayStartParams:\n  dashboard-host: '0.0.0.0'\n"
    assert public_binds(text) == ["dashboard-host=0.0.0.0", "dashboard-host=0.0.0.0"]
    assert public_binds("ray start --head --dashboard-host=127.0.0.1 --port=6379") == []


# ---------------------------------------------------------------- the tree


def test_package_never_unpickles_untrusted_bytes():
    hits = _scan(PACKAGE, unsafe_loads)
    assert not hits, "unsafe deserialisation (use safetensors, or torch.load(..., weights_only=True)):\n" + "\n".join(hits)


def test_package_and_job_entrypoints_never_use_a_shell():
    hits = _scan(PACKAGE, shell_calls) + (_scan(JOBS, shell_calls) if JOBS.is_dir() else [])
    assert not hits, "user input must reach processes as argv lists, never through a shell:\n" + "\n".join(hits)


def test_job_entrypoints_exist_and_are_scanned():
    if not JOBS.is_dir() or not _py_files(JOBS):
        pytest.skip("jobs/ has no Python entrypoints yet")
    for p in _py_files(JOBS):
        assert not unsafe_loads(p.read_text(encoding="utf-8"), str(p))


def _cluster_files() -> list[Path]:
    if not CLUSTER.is_dir():
        return []
    return sorted(p for p in CLUSTER.rglob("*") if p.is_file() and p.suffix in (".yaml", ".yml", ".sh", ".json", ""))


def test_cluster_configs_bind_dashboard_and_job_server_to_localhost_or_state_auth():
    files = _cluster_files()
    if not files:
        pytest.skip("cluster/ has no configs yet")
    problems = []
    for p in files:
        text = p.read_text(encoding="utf-8", errors="replace")
        binds = public_binds(text)
        if binds and not _AUTH_NOTE.search(text):
            problems.append(f"{p.relative_to(ROOT)}: {', '.join(binds)} with no word on authentication")
    assert not problems, (
        "the Ray dashboard/job server accepts unauthenticated job submission (= code execution): bind it to "
        "127.0.0.1, or say in the file how access is restricted (token auth, port-forward, private network):\n"
        + "\n".join(problems)
    )


def test_local_ray_started_by_the_cli_has_no_dashboard():
    """A locally started Ray must not open a job server on the network."""
    src = (PACKAGE / "ray_session.py").read_text(encoding="utf-8")
    calls = [n for n in ast.walk(ast.parse(src)) if isinstance(n, ast.Call) and _dotted(n.func) == ("ray", "init")]
    local = [c for c in calls if _kwarg(c, "address") is None]
    assert local, "ray_session.init_ray no longer starts a local Ray through ray.init(...)"
    for c in local:
        dash = _kwarg(c, "include_dashboard")
        host = _kwarg(c, "dashboard_host")
        assert (isinstance(dash, ast.Constant) and dash.value is False) or (
            isinstance(host, ast.Constant) and host.value in _LOCALHOST
        ), "a local ray.init must pass include_dashboard=False or dashboard_host='127.0.0.1'"
