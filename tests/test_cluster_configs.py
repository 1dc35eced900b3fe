"""cluster/ stays consistent with configs/ and jobs/: resources, entrypoints, images, bind addresses."""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

import pytest
import yaml

from eagle3_ray.config import load_config

ROOT = Path(__file__).resolve().parent.parent
CLUSTER = ROOT / "cluster"
K8S = CLUSTER / "k8s"
OVERLAYS = {"demo": "configs/demo-smollm2.yaml", "kimi-k2.5": "configs/kimi-k2.5.yaml"}


def _docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _kind(overlay: str, kind: str) -> dict:
    docs = [d for f in sorted((K8S / overlay).glob("*.yaml")) for d in _docs(f) if d.get("kind") == kind]
    assert len(docs) == 1, f"{overlay}: expected one {kind}"
    return docs[0]


def _containers(obj) -> list[dict]:
    """Every container spec anywhere in a manifest."""
    found = []
    if isinstance(obj, dict):
        for k, v in obj.items():
            if k == "containers":
                found.extend(v)
            else:
                found.extend(_containers(v))
    elif isinstance(obj, list):
        for v in obj:
            found.extend(_containers(v))
    return found


def _gpu_workers(cluster: dict) -> list[dict]:
    groups = []
    for g in cluster["spec"]["workerGroupSpecs"]:
        (c,) = g["template"]["spec"]["containers"]
        gpus = int(c["resources"]["limits"].get("nvidia.com/gpu", 0))
        groups.append({"gpus": gpus, "ray_gpus": int(g["rayStartParams"].get("num-gpus", gpus)),
                       "max_replicas": g["maxReplicas"]})
    return groups


def test_every_cluster_yaml_parses():
    files = sorted(CLUSTER.glob("**/*.yaml"))
    assert len(files) >= 9
    for f in files:
        assert _docs(f), f


@pytest.mark.parametrize("overlay", sorted(OVERLAYS))
def test_rayjob_entrypoint_runs_a_shipped_job_with_a_valid_config(overlay):
    job = _kind(overlay, "RayJob")
    cluster = _kind(overlay, "RayCluster")
    assert job["spec"]["clusterSelector"]["ray.io/cluster"] == cluster["metadata"]["name"]
    argv = shlex.split(job["spec"]["entrypoint"])
    assert argv[0] == "python" and (ROOT / argv[1]).is_file() and argv[1].startswith("jobs/")
    config = argv[argv.index("-c") + 1]
    assert config == OVERLAYS[overlay]
    overrides = [a for a in argv[2:] if "=" in a and not a.startswith("-")]
    load_config(ROOT / config, overrides)  # the job's config + overrides validate
    yaml.safe_load(job["spec"]["runtimeEnvYAML"])


def test_kimi_gpu_nodes_fit_the_tp_engine_training_and_bench():
    cfg = load_config(ROOT / OVERLAYS["kimi-k2.5"])
    (group,) = _gpu_workers(_kind("kimi-k2.5", "RayCluster"))
    assert group["gpus"] == group["ray_gpus"]
    # One SGLang engine spans tp_size GPUs of one node (multi-node TP would need target.sglang.nnodes).
    assert cfg.target.tp_size * cfg.target.sglang.nnodes == cfg.extract.num_gpus_per_actor
    assert cfg.extract.num_gpus_per_actor <= group["gpus"]
    assert (cfg.extract.max_actors or cfg.extract.num_actors) * cfg.extract.num_gpus_per_actor <= (
        group["gpus"] * group["max_replicas"])
    assert cfg.train.num_workers <= group["gpus"] * group["max_replicas"]
    assert cfg.bench.num_gpus <= group["gpus"]


def test_launcher_gpu_workers_fit_the_kimi_engine_and_head_is_local_only():
    launcher = _docs(CLUSTER / "ray-cluster.yaml")[0]
    cfg = load_config(ROOT / OVERLAYS["kimi-k2.5"])
    types = launcher["available_node_types"]
    assert types[launcher["head_node_type"]]["resources"].get("GPU", 0) == 0
    gpu_nodes = [t for t in types.values() if t["resources"].get("GPU", 0) > 0]
    assert gpu_nodes and all(t["resources"]["GPU"] >= cfg.extract.num_gpus_per_actor for t in gpu_nodes)
    (head_start,) = [c for c in launcher["head_start_ray_commands"] if "--head" in c]
    assert "--dashboard-host=127.0.0.1" in head_start


def test_kimi_rayjob_nccl_env_matches_the_config():
    cfg = load_config(ROOT / OVERLAYS["kimi-k2.5"])
    env = yaml.safe_load(_kind("kimi-k2.5", "RayJob")["spec"]["runtimeEnvYAML"])["env_vars"]
    nccl = {k: v for k, v in env.items() if k.startswith("NCCL_")}
    assert nccl and nccl == {k: v for k, v in cfg.ray.env_vars.items() if k.startswith("NCCL_")}


def test_images_are_named_in_one_place():
    component = _docs(K8S / "images" / "kustomization.yaml")[0]
    assert component["kind"] == "Component"
    placeholders = {i["name"] for i in component["images"]}
    for overlay in OVERLAYS:
        kust = _docs(K8S / overlay / "kustomization.yaml")[0]
        assert "../images" in kust["components"]
        for res in kust["resources"]:
            for doc in _docs(K8S / overlay / res):
                for c in _containers(doc):
                    assert c["image"] in placeholders, f"{overlay}/{res}: {c['image']}"
    registry_refs = [f for f in CLUSTER.glob("**/*.yaml")
                     if f.parent.name != "images" and re.search(r"image:\s*\S+[/:]", f.read_text())]
    assert not registry_refs, f"image names outside cluster/k8s/images: {registry_refs}"


@pytest.mark.parametrize("overlay", sorted(OVERLAYS))
def test_k8s_heads_are_not_exposed_and_say_what_protects_them(overlay):
    cluster = _kind(overlay, "RayCluster")
    assert cluster["spec"]["headGroupSpec"]["serviceType"] == "ClusterIP"
    assert "SECURITY" in (K8S / overlay / "raycluster.yaml").read_text()


def test_local_head_script_binds_dashboard_to_localhost_and_never_runs_ray_stop():
    script = (CLUSTER / "local-head.sh").read_text()
    subprocess.run(["bash", "-n", str(CLUSTER / "local-head.sh")], check=True)
    assert "--dashboard-host 127.0.0.1" in script
    assert not re.search(r"^\s*ray stop", script, re.M)  # it would kill every Ray of the user


def test_runtime_envs_parse_and_pip_packages_are_project_dependencies():
    import tomllib

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    names = {re.split(r"[<>=\[ ]", d)[0].lower() for d in deps}
    for name in ("runtime_env.yaml", "runtime_env.pip.yaml"):
        env = _docs(CLUSTER / name)[0]
        assert env["env_vars"]["RAY_TRAIN_V2_ENABLED"] == "1"
        assert ".git" in env["excludes"]
    pip = _docs(CLUSTER / "runtime_env.pip.yaml")[0]["pip"]["packages"]
    assert {re.split(r"[<>=\[ ]", p)[0].lower() for p in pip} <= names
