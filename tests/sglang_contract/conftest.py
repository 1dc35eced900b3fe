"""The SGLang contract suite runs once per supported SGLang version, each in its own pytest process.

``tests/test_sglang_versions.py`` (main session) starts ``python -m pytest tests/sglang_contract`` with
``PYTHONPATH=.deps/sglang-<version>`` (``make sglang-src`` installs each version there, --no-deps)
and ``EAGLE3_SGLANG_VERSION=<version>``. Without that variable this directory collects nothing, so
the main session never runs these tests against whatever SGLang happens to be importable.
By hand:  EAGLE3_SGLANG_VERSION=0.5.17 PYTHONPATH=.deps/sglang-0.5.17 python -m pytest -q tests/sglang_contract

Inside the suite nothing is skipped: a missing package fails the session, naming it.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

import pytest

VERSION_ENV = "EAGLE3_SGLANG_VERSION"
FAKES = Path(__file__).parent / "fakes"

if not os.environ.get(VERSION_ENV):
    collect_ignore_glob = ["test_*.py"]
else:
    # PyPI's torchvision is a CUDA build that cannot import next to CPU torch; SGLang 0.5.17 imports
    # it at module level. The FAKE (tests/sglang_contract/fakes, named as such) stands in only then.
    try:
        import torchvision  # noqa: F401
    except Exception:
        sys.modules.pop("torchvision", None)
        sys.path.insert(0, str(FAKES))


def pytest_sessionstart(session):
    want = os.environ.get(VERSION_ENV)
    if not want:
        return
    try:
        import sglang
        import sglang.srt.model_executor.hook_manager  # noqa: F401
        import sglang.srt.sampling.sampling_params  # noqa: F401
        import sglang.srt.server_args  # noqa: F401
    except ImportError as e:
        pytest.exit(
            f"SGLang {want} contract suite: cannot import {e.name!r} ({e}); install the package into the venv "
            f"(requirements-sglang-cpu*.txt, `make sglang-src`)", returncode=3)
    got = getattr(sglang, "__version__", None)
    if got != want:
        pytest.exit(f"SGLang contract suite: {VERSION_ENV}={want} but sglang {got} is imported from "
                    f"{Path(sglang.__file__).parent} (PYTHONPATH=.deps/sglang-{want})", returncode=3)


@pytest.fixture(scope="session")
def sglang_version() -> str:
    return os.environ[VERSION_ENV]


def source_root() -> Path:
    spec = importlib.util.find_spec("sglang")
    assert spec is not None and spec.submodule_search_locations, "sglang is not importable"
    return Path(spec.submodule_search_locations[0])


def compile_sglang_def(node: ast.AST, namespace: dict[str, Any], base: str | None = None,
                       keep_decorators: set[str] | None = None):
    """Compile one class or function definition of SGLang's source into ``namespace`` and return it.

    Annotations are dropped, or become strings in class bodies (their types live in modules that need
    CUDA to import); a class's bases are replaced by ``base`` (a mixin without fields) when given;
    ``keep_decorators``: the decorators kept by name (None: all).
    """
    node = ast.parse(ast.unparse(node)).body[0]
    if base is not None:
        node.bases = [ast.Name(base, ast.Load())]
        namespace.setdefault(base, object)
    for sub in ast.walk(node):
        if isinstance(sub, ast.AnnAssign):
            sub.annotation = ast.Constant(ast.unparse(sub.annotation))
        if isinstance(sub, ast.arguments):
            for a in sub.posonlyargs + sub.args + sub.kwonlyargs:
                a.annotation = None
        if isinstance(sub, ast.FunctionDef):
            sub.returns = None
            if keep_decorators is not None:
                sub.decorator_list = [d for d in sub.decorator_list if ast.unparse(d) in keep_decorators]
    ast.fix_missing_locations(node)
    exec(compile(ast.Module([node], []), f"<sglang {getattr(node, 'name', '')}>", "exec"), namespace)
    return namespace[node.name]


@pytest.fixture()
def target(tmp_path, tiny_llama_config):
    """A tiny Llama on disk as an SGLang target, capture_dir in tmp: for the engine tests with a fake engine."""
    import torch

    from eagle3_ray.config import TargetConfig

    d = tmp_path / "tiny-llama"
    tiny_llama_config.torch_dtype = torch.float32
    tiny_llama_config.save_pretrained(d)
    return TargetConfig(model=str(d), backend="sglang", tp_size=1, dtype="float32", aux_layers=[2, 3, 4],
                        sglang={"capture_dir": str(tmp_path / "shm")})
