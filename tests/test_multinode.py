"""Multi-node on one machine: a real Ray cluster of several nodes on loopback addresses (issue 22).

One cluster for the whole module (tests/loopback_cluster.py): a head on 127.0.0.2 and a worker
node on 127.0.0.3 (logical CPUs: HEAD_CPUS, WORKER_CPUS), token auth on, every address loopback. The module drives it from
this process: its fixture shuts the session's local Ray (conftest ``ray_local``) down, connects to
the cluster, and restores the local Ray at the end. That costs one ``ray.init`` each way, less than a
subprocess driver per scenario (each would import torch, transformers and Ray again).

Scenarios, each one run whose checks are separate tests:
  * ``ray job submit`` of ci-tiny (prepare + extract, two engine actors) to the two nodes: the
    actors spread one per node and each shard marker names the node that wrote it.
  * Ray Train with one worker per node: every process of the 127.0.0.3 node is SIGKILLed after the
    first checkpoint; the head alone cannot hold both workers, the node comes back on its address (a
    new Ray node, its own mount namespace) and training resumes from the last checkpoint on both.
    That node sees a directory of its own at NODE_LOCAL: Ray Train storage there is refused at start.
  * an extraction held mid-run (its engine actors, the stage's own class with a wait added by this test,
    wait after each commit while a hold file exists):
    a third node joins and the elastic pool puts an actor on it, then the 127.0.0.3 node's raylet is
    SIGKILLed; released, the run ends with every sample committed once.
  * ``--out`` on a per-node path (/proc/self/cwd/..., each node's processes run in their own
    directory): extraction refuses to start and names the node that cannot see it.
"""

from __future__ import annotations

import io
import json
import os
import re
import time
from collections import Counter
from contextlib import redirect_stdout
from pathlib import Path

import pytest

from loopback_cluster import HEAD_IP, LoopbackCluster, is_loopback, non_loopback_nodes

pytestmark = pytest.mark.ray

CI_CONFIG = "configs/ci-tiny.yaml"
WORKER_IP = "127.0.0.3"
JOINER_IP = "127.0.0.4"
ENGINE_ACTOR_CLASS = "MapWorker(MapBatches(CaptureWriteUDF))"
# Logical CPUs that make placement deterministic: an engine actor takes ACTOR_CPUS, so the head
# holds one actor and keeps one CPU for Ray Data's read tasks (an actor pool holding every CPU
# starves them: the run hangs), and each worker node holds exactly one actor.
HEAD_CPUS, WORKER_CPUS, ACTOR_CPUS = 3, 2, 2
ACTORS = f"extract.num_cpus_per_actor={ACTOR_CPUS}"
NODE_LOCAL = "node-local"  # under the cluster's root: the node that comes back sees its own, empty one


@pytest.fixture(scope="module")
def cluster(ci_tiny_inputs, start_local_ray):
    """The module's two-node loopback cluster, with this process as its driver.

    ``ci_tiny_inputs`` (prepared data, features, vocab) is built first, on the session's local Ray,
    which is then shut down (one process is the driver of one cluster) and started again after the
    module."""
    import ray

    had_local = ray.is_initialized()
    ray.shutdown()
    saved = {k: os.environ.get(k) for k in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN")}
    c = LoopbackCluster(workers=1, head_cpus=HEAD_CPUS, worker_cpus=WORKER_CPUS).start()
    hold = c.root / "hold"
    try:
        # Training workers' gloo binds the loopback interface (its default is the host name's address).
        c.connect(log_to_driver=False, configure_logging=False,
                  runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false", "GLOO_SOCKET_IFNAME": "lo"}})
        c.hold = hold
        yield c
    finally:
        ray.shutdown()
        c.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        if had_local:
            start_local_ray()


def _markers(store: Path) -> list[dict]:
    from eagle3_ray.features.store import manifest

    return manifest(store)


def _assert_each_sample_once(store: Path, prepared: Path) -> list[dict]:
    import pyarrow.parquet as pq

    want = sorted(pq.read_table(prepared).column("sample_id").to_pylist())
    markers = _markers(store)
    stored = [sid for m in markers for sid in m["sample_ids"]]
    counts = Counter(stored)
    assert sorted(counts) == want, f"lost: {sorted(set(want) - set(counts))}"
    assert max(counts.values()) == 1, f"duplicated: {[s for s, n in counts.items() if n > 1]}"
    return markers


# ---------------------------------------------------------------- the cluster itself


def test_every_node_advertises_a_loopback_address(cluster):
    import ray

    nodes = [n for n in ray.nodes() if n["Alive"]]
    assert sorted(n["NodeManagerAddress"] for n in nodes) == [HEAD_IP, WORKER_IP]
    assert non_loopback_nodes(ray.nodes()) == []
    assert all(is_loopback(n["NodeManagerAddress"]) for n in ray.nodes())
    assert ray.util.get_node_ip_address() == HEAD_IP  # the driver joined as the head's address


# ---------------------------------------------------------------- ray job submit to two nodes


@pytest.fixture(scope="module")
def two_node_job(cluster, tmp_path_factory):
    from test_jobs import submit_pipeline_job

    out = tmp_path_factory.mktemp("multinode_job") / "run"
    return submit_pipeline_job(cluster.client_env(), out, stop_after="extract",
                               overrides=("extract.num_actors=2", "extract.max_actors=2", ACTORS))


def test_job_submitted_to_two_nodes_extracts_every_sample_once(two_node_job, ci_tiny_prepared):
    assert two_node_job["status"] == "SUCCEEDED", two_node_job["logs"][-4000:]
    assert "stopped after extract" in two_node_job["logs"]
    _assert_each_sample_once(two_node_job["out"] / "features", ci_tiny_prepared[1].prepared)


def _actor_node_ip(actor, ip_of: dict[str, str]) -> str:
    """The address of the node Ray placed an actor on: from its node id, or for an ended actor whose
    record lost the id, from its death record. An actor the job outran (its constructor still running
    when the dataset finished: ``never_started``) was still placed where Ray leased it a worker
    process (the record's pid and node address); only one without a worker was never placed."""
    if actor.node_id in ip_of:
        return ip_of[actor.node_id]
    context = (actor.death_cause or {}).get("actor_died_error_context") or {}
    leased = not context.get("never_started", True) or context.get("pid")
    return context.get("node_ip_address") if leased and context.get("node_ip_address") else "never placed"


def test_engine_actors_spread_and_markers_name_their_node(two_node_job, cluster):
    """Placement from Ray's state API (the job's actors have ended, their records stay): one engine
    actor per node. The markers name the node that wrote each shard (on a run this small one actor
    may commit every batch before the other is up; the held run below checks shards from each node)."""
    import ray
    from ray.util.state import list_actors

    actors = list_actors(address=cluster.job_api, filters=[("class_name", "=", ENGINE_ACTOR_CLASS)],
                         detail=True, raise_on_missing_output=False)
    ip_of = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
    placed = sorted(_actor_node_ip(a, ip_of) for a in actors)
    assert placed == [HEAD_IP, WORKER_IP], f"engine actors placed on {placed}: " + "; ".join(
        f"{a.state} {a.node_id} {a.death_cause}" for a in actors)
    markers = _markers(two_node_job["out"] / "features")
    for m in markers:  # the node recorded is the Ray node (address and id) of the actor that wrote it
        assert ip_of[m["node"]["id"]] == m["node"]["ip"] and m["node"]["ip"] in placed
    lines = [ln for ln in two_node_job["logs"].splitlines() if "[extract] engine actor" in ln]
    assert {re.search(r"on node (\S+):", ln).group(1) for ln in lines} == {m["node"]["ip"] for m in markers}


# ---------------------------------------------------------------- Ray Train across nodes, a node lost

TRAIN_STEPS, TRAIN_EVERY = 12, 2  # 12 steps x 2 workers: every one of ci-tiny's 24 packs
TRAIN_WORKER_CLASS = "RayTrainWorker"


def _train_metrics(out: Path) -> list[dict]:
    """The steps rank 0 logged (a line it is still appending is left out)."""
    path = out / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines(keepends=True) if line.endswith("\n")] \
        if path.is_file() else []


def _node_id(ip: str) -> str:
    import ray

    [node] = [n["NodeID"] for n in ray.nodes() if n["Alive"] and n["NodeManagerAddress"] == ip]
    return node


def _train_workers(cluster) -> list:
    from ray.util.state import list_actors

    return list_actors(address=cluster.job_api, filters=[("class_name", "=", TRAIN_WORKER_CLASS)], detail=True,
                       raise_on_missing_output=False)


@pytest.fixture(scope="module")
def training_node_lost(cluster, ci_tiny_inputs, tmp_path_factory):
    """ci-tiny training on two Ray Train workers of WORKER_CPUS each: the head (HEAD_CPUS) holds one
    and keeps a CPU for the pack loader, the 127.0.0.3 node the other. Once a step past the first
    checkpoint is logged, every process of that node is SIGKILLed (a lost machine). The head alone
    cannot hold both workers, so Ray Train's restart waits; the node comes back on its address and
    the run goes on to the end. Returns what the tests check."""
    import ray

    from eagle3_ray.config import load_config
    from eagle3_ray.train.trainer import run_training
    from test_fault_injection import Background, _wait_for

    cfg = load_config(CI_CONFIG, ["train.num_workers=2", f"train.cpus_per_worker={WORKER_CPUS}",
                                  f"train.max_steps={TRAIN_STEPS}", f"train.checkpoint_every={TRAIN_EVERY}",
                                  "train.log_every=1", "train.max_failures=2"])
    out = tmp_path_factory.mktemp("multinode_train") / "train"
    lost = next(w for w in cluster.workers if w.alive() and w.ip == WORKER_IP)
    head_id, lost_id = _node_id(HEAD_IP), _node_id(WORKER_IP)
    t0 = time.monotonic()
    times, killed = {}, []
    run = Background(lambda: run_training(cfg, ci_tiny_inputs / "features", ci_tiny_inputs / "vocab", out))
    try:
        # a step logged after the first checkpoint's report: that checkpoint is registered
        _wait_for("a step past the first checkpoint",
                  lambda: any(m["step"] > TRAIN_EVERY + 1 for m in _train_metrics(out)), run.alive)
        logged_at_kill = max(m["step"] for m in _train_metrics(out))
        times["killed_at_s"] = time.monotonic() - t0
        killed = cluster.kill_node(lost)
        killed_at = time.monotonic()
        alive_at_kill = run.alive()
        _wait_for("the lost node to be declared dead",
                  lambda: not any(n["Alive"] for n in ray.nodes() if n["NodeID"] == lost_id), run.alive, poll_s=0.5)
        times["death_detected_after_kill_s"] = time.monotonic() - killed_at
    finally:
        if killed:  # the node comes back (also when the checks above fail: later scenarios need it)
            back = cluster.add_worker(ip=WORKER_IP, node_local=cluster.root / NODE_LOCAL)
    times["node_back_after_kill_s"] = time.monotonic() - killed_at
    final = run.join()
    times["run_s"] = time.monotonic() - t0
    workers = _train_workers(cluster)
    ip_of = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
    return {"final": final, "logged": _train_metrics(out), "logged_at_kill": logged_at_kill, "killed": killed,
            "alive_at_kill": alive_at_kill, "head_id": head_id,
            "lost_id": lost_id, "back": back, "back_id": _node_id(WORKER_IP),
            "placed": sorted(_actor_node_ip(a, ip_of) for a in workers), "worker_node_ids": [a.node_id for a in workers],
            "times": {k: round(v, 1) for k, v in times.items()}}


def test_node_lost_mid_training_resumes_from_the_last_checkpoint(training_node_lost):
    from eagle3_ray.train.checkpoint import consumed_packs, read_train_state

    r = training_node_lost
    assert r["killed"] and r["alive_at_kill"] and r["logged_at_kill"] < TRAIN_STEPS, "the loss must land mid-training"
    state = read_train_state(r["final"])
    assert state["step"] == TRAIN_STEPS and state["world_size"] == 2
    seq = [m["step"] for m in r["logged"]]
    # Each row names the checkpoint step its attempt started from: 0, then the one resumed from. A
    # restart from the last step logged repeats no step, so the step numbers alone cannot show it.
    starts = [m["resumed_from"] for m in r["logged"]]
    i = next((k for k, s in enumerate(starts) if s != 0), None)
    assert i is not None and set(starts[i:]) == {starts[i]}, f"exactly one restart expected: {list(zip(seq, starts))}"
    resumed_from = starts[i]
    assert TRAIN_EVERY <= resumed_from <= seq[i - 1] and resumed_from % TRAIN_EVERY == 0, (
        f"resumed at step {resumed_from}, not a checkpoint of the first attempt (its last step logged: {seq[i - 1]})")
    assert seq[:i] == list(range(1, seq[i - 1] + 1)) and seq[i:] == list(range(resumed_from + 1, TRAIN_STEPS + 1))
    before, after = {m["step"]: m for m in r["logged"][:i]}, {m["step"]: m for m in r["logged"][i:]}
    for s in set(before) & set(after):  # the LR schedule continues where the checkpoint left it
        assert after[s]["lr"] == pytest.approx(before[s]["lr"], rel=1e-6)
    # Data position: one pack per worker per step, none consumed twice across the restart.
    assert len(consumed_packs(r["final"])) == 2 * TRAIN_STEPS
    print("[reliability] multinode-train", json.dumps({  # figures for docs/reliability.md (pytest -s)
        "step_logged_at_loss": r["logged_at_kill"], "resumed_from_step": resumed_from,
        "final_step": state["step"], "processes_killed": len(r["killed"]), **r["times"]}))


def test_training_ran_one_worker_per_node_before_and_after_the_loss(training_node_lost):
    import ray

    r = training_node_lost
    # Two attempts, each one worker on the head (it holds one: HEAD_CPUS < 2 * WORKER_CPUS) and one
    # on 127.0.0.3: the lost node, then the new one.
    assert r["placed"] == [HEAD_IP, HEAD_IP, WORKER_IP, WORKER_IP], r["placed"]
    assert r["back_id"] != r["lost_id"] and r["back_id"] in r["worker_node_ids"]
    assert r["head_id"] in r["worker_node_ids"]
    assert not any(n["Alive"] for n in ray.nodes() if n["NodeID"] == r["lost_id"])
    assert non_loopback_nodes(ray.nodes()) == []


def test_train_storage_that_a_node_cannot_see_fails_at_start(training_node_lost, cluster, ci_tiny_inputs, tmp_path):
    """Ray Train storage on a directory that the node which came back sees as its own (empty) one:
    refused before any training worker starts, naming that node."""
    from eagle3_ray.config import load_config
    from eagle3_ray.errors import PreflightError
    from eagle3_ray.train.trainer import run_training

    storage = cluster.root / NODE_LOCAL / "ray_train"
    cfg = load_config(CI_CONFIG, ["train.num_workers=2", f"train.cpus_per_worker={WORKER_CPUS}",
                                  f"ray.storage_path={storage}"])
    with pytest.raises(PreflightError) as err:
        run_training(cfg, ci_tiny_inputs / "features", ci_tiny_inputs / "vocab", tmp_path / "train")
    msg = str(err.value)
    assert msg.startswith(f"ray.storage_path (Ray Train's checkpoints) {storage} is not visible from Ray node(s) "
                          f"{WORKER_IP} (1 of 2 nodes see it)"), msg
    assert "--out" not in msg and "storage that every node mounts" in msg  # the head and that node share --out
    assert not (tmp_path / "train" / "metrics.jsonl").exists() and not list(storage.iterdir())
    assert len(_train_workers(cluster)) == len(training_node_lost["placed"])  # no training worker started


# ---------------------------------------------------------------- a node joins, a node dies

SCRAPE_TIMEOUT_S = 60
SERIES = re.compile(r'^ray_eagle3_samples_total\{(?P<tags>[^}]*)\} (?P<value>\S+)$', re.M)


def _store_samples(node) -> float:
    """ci-tiny samples committed by engine actors on ``node``, from that node's metrics endpoint."""
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://{node.ip}:{node.ports['metrics']}/metrics", timeout=5) as r:
            text = r.read().decode()
    except OSError:
        return 0.0
    return sum(float(m["value"]) for m in SERIES.finditer(text)
               if 'stage="store"' in m["tags"] and 'run="ci-tiny"' in m["tags"])



def held(cls, hold: Path):
    """``cls``, the extract stage's engine actor, waiting after each batch it commits while the file
    ``hold`` exists: a run is held mid-way (a node joins, a node dies) without timing. It keeps the
    stage's class name (the engine actors' process title); cloudpickle sends the class itself."""

    class Held(cls):
        def __call__(self, batch):
            rows = super().__call__(batch)
            if any(status != "skipped" for status in rows["status"]):
                while hold.exists():
                    time.sleep(0.1)
            return rows

    Held.__name__ = cls.__name__
    return Held


@pytest.fixture(scope="module")
def held_extraction(cluster, ci_tiny_prepared, tmp_path_factory):
    """ci-tiny extraction with one sample per batch, held after each commit until the test has added
    a node (127.0.0.4, room for the pool's third actor and a restarted one) and SIGKILLed
    the 127.0.0.3 node's raylet. Returns the store, the progress lines and what happened."""
    import ray

    from eagle3_ray.config import load_config
    from eagle3_ray.extract import udfs
    from eagle3_ray.extract.pipeline import run_extract
    from test_fault_injection import Background, _wait_for

    cfg = load_config(CI_CONFIG, ["extract.num_actors=2", "extract.max_actors=3", "extract.batch_tokens=1", ACTORS])
    store = tmp_path_factory.mktemp("multinode_held") / "features"
    cluster.hold.touch()
    stdout = io.StringIO()

    def nodes_written() -> set[str]:
        return {m.get("node", {}).get("ip") for m in _markers(store)} if (store / "shards").is_dir() else set()

    t0 = time.monotonic()
    times = {}
    with pytest.MonkeyPatch.context() as patch, redirect_stdout(stdout):
        # run_extract takes the engine actor's class from udfs when it starts (the seam test_engine_start uses too)
        patch.setattr(udfs, "CaptureWriteUDF", held(udfs.CaptureWriteUDF, cluster.hold))
        run = Background(lambda: run_extract(cfg, ci_tiny_prepared[0], store))
        try:
            _wait_for("a shard from each of the two nodes", lambda: {HEAD_IP, WORKER_IP} <= nodes_written(),
                      run.alive, poll_s=0.2)
            times["both_nodes_wrote_s"] = time.monotonic() - t0
            joiner = cluster.add_worker(num_cpus=2 * ACTOR_CPUS)
            times["node_joined_s"] = time.monotonic() - t0
            _wait_for("a shard from the node that joined", lambda: JOINER_IP in nodes_written(), run.alive,
                      poll_s=0.2)
            times["joiner_wrote_s"] = time.monotonic() - t0
            # The new actor's work on the joined node's own Prometheus endpoint, while it is held
            # (alive): Ray exports a node's series every few seconds.
            joiner_samples = _wait_for("the joined node's metrics", lambda: _store_samples(joiner), run.alive,
                                       deadline_s=SCRAPE_TIMEOUT_S, poll_s=1.0)
            times["joiner_metrics_s"] = time.monotonic() - t0
            written_before_kill = len(_markers(store))
            cluster.kill_raylet(next(w for w in cluster.workers if w.ip == WORKER_IP and w.alive()))
            killed_at = time.monotonic()
            _wait_for("the killed node to be declared dead",
                      lambda: not any(n["Alive"] for n in ray.nodes() if n["NodeManagerAddress"] == WORKER_IP),
                      run.alive, poll_s=0.5)
            times["death_detected_after_kill_s"] = time.monotonic() - killed_at
        finally:
            cluster.hold.unlink(missing_ok=True)
        run.join()
    times["run_s"] = time.monotonic() - t0
    return {"store": store, "summary": run.result, "lines": stdout.getvalue().splitlines(),
            "joiner": joiner, "written_before_kill": written_before_kill, "joiner_samples": joiner_samples,
            "times": {k: round(v, 1) for k, v in times.items()}}


def test_node_death_mid_extraction_loses_and_duplicates_nothing(held_extraction, ci_tiny_prepared):
    import ray

    assert held_extraction["summary"].samples == 12
    _assert_each_sample_once(held_extraction["store"], ci_tiny_prepared[1].prepared)
    # The kill landed mid-run: samples were still to do when the node died.
    assert held_extraction["written_before_kill"] < 12
    at_worker_ip = [n["Alive"] for n in ray.nodes() if n["NodeManagerAddress"] == WORKER_IP]
    assert at_worker_ip and not any(at_worker_ip)
    per_node = Counter(m["node"]["ip"] for m in _markers(held_extraction["store"]))
    print("[reliability] multinode", json.dumps({  # figures for docs/reliability.md (pytest -s)
        "shards_per_node": dict(per_node), "shards_before_kill": held_extraction["written_before_kill"],
        **held_extraction["times"]}))


def test_a_node_joining_mid_extraction_gets_an_engine_actor(held_extraction):
    markers = _markers(held_extraction["store"])
    assert {m["node"]["ip"] for m in markers} == {HEAD_IP, WORKER_IP, JOINER_IP}
    joined = [ln for ln in held_extraction["lines"] if "[extract] engine actor" in ln and f"node {JOINER_IP}:" in ln]
    assert joined, "no progress line names the engine actor on the node that joined:\n" + "\n".join(
        held_extraction["lines"])
    # The dashboard metrics of the node that joined show its engine actor's committed samples.
    assert held_extraction["joiner_samples"] >= 1


# ---------------------------------------------------------------- shared storage


def test_out_that_a_node_cannot_see_fails_at_start(cluster, ci_tiny_prepared):
    """--out under /proc/self/cwd/ is a per-node path here (each node's processes run in their own
    directory): the driver, in the head's directory, sees it, the worker node another directory."""
    from eagle3_ray.config import load_config
    from eagle3_ray.errors import PreflightError
    from eagle3_ray.extract.pipeline import run_extract

    cfg = load_config(CI_CONFIG)
    here = os.getcwd()
    os.chdir(cluster.head.cwd)
    try:
        with pytest.raises(PreflightError) as err:
            run_extract(cfg, ci_tiny_prepared[0], "/proc/self/cwd/per-node-store")
    finally:
        os.chdir(here)
    alive_workers = [w.ip for w in cluster.workers if w.alive()]
    msg = str(err.value)
    assert "--out" in msg and "not visible from Ray node(s)" in msg and "storage that every node mounts" in msg
    blind = re.search(r"not visible from Ray node\(s\) ([^(]+) \(", msg).group(1).split(", ")
    assert sorted(blind) == sorted(alive_workers), msg  # the head sees it, every worker node does not
    assert not list((cluster.head.cwd / "per-node-store" / "shards").glob("*.done.json"))  # refused before work
