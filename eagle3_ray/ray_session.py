"""Connect to the Ray cluster named by the config, or start a local one (thin Ray layer)."""

from __future__ import annotations

import json
import logging
import os
import secrets
import threading
from pathlib import Path

from eagle3_ray.config import RayConfig

log = logging.getLogger(__name__)

# Ray hides GPUs from tasks that ask for none, which breaks CPU-only local runs on GPU laptops less
# than it helps; TOKENIZERS_PARALLELISM=false avoids fork warnings in Ray Data workers.
_DEFAULT_ENV = {"TOKENIZERS_PARALLELISM": "false", "RAY_TRAIN_V2_ENABLED": "1"}
# The address of this machine's Ray node for a driver that joins a cluster (ray.init's
# _node_ip_address). Unset, Ray guesses the address of the interface that routes outwards, which
# is not the node's when nodes are started with --node-ip-address (e.g. several on loopback).
NODE_IP_ENV = "EAGLE3_RAY_NODE_IP"
# Ray Train's PlacementGroupCleaner (a detached actor of every training run) asks the State API each
# second whether the run's controller lives. The State API is served by the dashboard, which a local
# start leaves out, so every check logged "Failed to query Ray Train Controller actor state ...",
# forwarded to the driver: 665 lines in one `make demo`. The driver's log forwarding skips that one
# line (Ray's RAY_DEDUP_LOGS_SKIP_REGEX, read when Ray is imported: set here, as the CLI imports
# this module before Ray). A value of the user's own is kept.
QUIET_WORKER_LINES = r"Failed to query Ray Train Controller actor state"
os.environ.setdefault("RAY_DEDUP_LOGS_SKIP_REGEX", QUIET_WORKER_LINES)


def _import_ray_data() -> threading.Thread:
    """Import Ray Data on a thread (seconds), so that it overlaps ray.init's wait for its processes
    (GCS, raylet, agents): the stages need it right after, init_ray itself for its DataContext."""

    def work() -> None:
        try:
            import ray.data  # noqa: F401
        except Exception:  # noqa: BLE001 (imported again, with its error, by init_ray)
            pass

    t = threading.Thread(target=work, name="import-ray-data", daemon=True)
    t.start()
    return t


def _job_env_vars() -> dict[str, str]:
    """env_vars of the runtime_env given to `ray job submit` ({} outside a submitted job).

    Inside a submitted job Ray merges ray.init's runtime_env into the job's and refuses (ValueError)
    when both set the same env var key, so the driver must leave those keys to the job.
    """
    raw = os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR")
    if not raw:
        return {}
    return dict((json.loads(raw).get("runtime_env") or {}).get("env_vars") or {})


def init_ray(cfg: RayConfig):
    """Return the initialized `ray` module: an existing session, cfg.address, $RAY_ADDRESS, or local."""
    import ray

    for k, v in _DEFAULT_ENV.items():
        os.environ.setdefault(k, v)
    if ray.is_initialized():
        return ray
    ray_data = _import_ray_data()
    job_env = _job_env_vars()
    env_vars = {k: v for k, v in {**_DEFAULT_ENV, **cfg.env_vars}.items() if k not in job_env}
    address = cfg.address or os.environ.get("RAY_ADDRESS")
    kwargs = dict(log_to_driver=True, configure_logging=False)
    if address:
        node_ip = os.environ.get(NODE_IP_ENV)
        if node_ip:
            kwargs["_node_ip_address"] = node_ip
        ray.init(address=address, runtime_env={"env_vars": env_vars} if env_vars else None, **kwargs)
    else:
        # A local cluster's processes inherit this process's environment: the variables go there,
        # not into a runtime_env. A job runtime_env would keep Ray from handing the stage's first
        # tasks and actors the workers it prestarts, and put the runtime-env agent on their start.
        os.environ.update(env_vars)
        ray.init(num_cpus=cfg.num_cpus, include_dashboard=False, **kwargs)
    ray_data.join()
    import ray.data

    ray.data.DataContext.get_current().enable_progress_bars = True
    return ray


# What Ray retries (docs/reliability.md "Retried, or failing fast"): a task whose worker process died
# (its node lost, the process killed) runs again, up to this many times (Ray's own default). An
# exception raised by the task's code does not: it would be raised again (a config that cannot
# work, an engine that cannot start: EngineStartError), so it ends the stage at once.
PROCESS_RETRIES = 3


def fail_fast_remote(fn, **options):
    """``ray.remote(**options)(fn)`` for a task that Ray runs again only when its worker process died
    (``max_retries``, default PROCESS_RETRIES), never when it raised (``retry_exceptions=False``): the
    exception (e.g. RayTaskError(EngineStartError)) reaches ``ray.get`` at once, and the CLI prints it
    as the stage's one-line error (exit status 2). For actors, nothing is needed: Ray restarts an
    actor (``max_restarts``) only when its process died, never when its constructor raised."""
    import ray

    options.setdefault("max_retries", PROCESS_RETRIES)
    if options.get("retry_exceptions"):
        raise ValueError("fail_fast_remote: retry_exceptions would run a failing task again; leave it unset")
    return ray.remote(**{**options, "retry_exceptions": False})(fn)


SHARED_CHECK_TIMEOUT_S = 120


def _read_probes(paths: list[str]) -> tuple[str, list[str]]:
    """(this node's address, each probe's content, "" where this node cannot read it)."""
    import ray

    seen = []
    for path in paths:
        try:
            with open(path, encoding="utf-8") as f:
                seen.append(f.read())
        except OSError:
            seen.append("")
    return ray.util.get_node_ip_address(), seen


def check_shared_dir(path: str | Path, what: str) -> None:
    """Refuse to start when a node of the cluster cannot see the directory ``path`` (PreflightError);
    see check_shared_dirs."""
    check_shared_dirs({path: what})


def check_shared_dirs(dirs: dict[str | Path, str]) -> None:
    """Refuse to start when a node of the cluster cannot see one of the directories ``dirs`` (path ->
    what it is, for the message), with a PreflightError naming the directories and the nodes.

    Stage outputs written or read by actors on every node (the feature store, Ray Train's
    checkpoints) must be on storage that every node mounts at the same path. The driver creates each
    directory, writes a probe file with a random token there, and one zero-CPU task per alive node
    reads them all back; a node that sees no file, or another file at that path (a node-local
    directory of the same name), fails the check. A one-node cluster passes without a task.
    """
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from eagle3_ray.errors import PreflightError

    nodes = [n for n in ray.nodes() if n.get("Alive")]
    if len(nodes) < 2 or not dirs:
        return
    paths = [Path(p) for p in dirs]
    tokens = [secrets.token_hex(16) for _ in paths]
    probes = [p / f".shared-check-{t[:8]}" for p, t in zip(paths, tokens)]
    try:
        for probe, token in zip(probes, tokens):
            probe.parent.mkdir(parents=True, exist_ok=True)
            probe.write_text(token, encoding="utf-8")
        read = ray.remote(num_cpus=0)(_read_probes)
        refs = [read.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False))
                .remote([str(p) for p in probes]) for n in nodes]
        seen = ray.get(refs, timeout=SHARED_CHECK_TIMEOUT_S)
    finally:
        for probe in probes:
            probe.unlink(missing_ok=True)
    problems = []
    for i, (path, what) in enumerate(zip(paths, dirs.values())):
        blind = sorted(ip for ip, contents in seen if contents[i] != tokens[i])
        log.info("shared-storage check of %s: %d node(s), blind: %s", path, len(seen), blind or "none")
        if blind:
            problems.append(f"{what} {path} is not visible from Ray node(s) {', '.join(blind)} "
                            f"({len(seen) - len(blind)} of {len(seen)} nodes see it)")
    if problems:
        raise PreflightError(
            "; ".join(problems) + ": every node that runs this stage's actors or workers uses it. Put it on "
            "storage that every node mounts at the same path (NFS, a shared volume), or run on one node"
        )
