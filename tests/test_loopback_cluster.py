"""The loopback cluster's node start (tests/loopback_cluster.py): Ray's startup timeout, and only it,
starts a worker again. No Ray starts here: `ray start` is replaced by plain processes and logs."""

from __future__ import annotations

import subprocess
import sys

import pytest

from loopback_cluster import START_ATTEMPTS, LoopbackCluster, Node, NodeStartTimedOut

TIMED_OUT = ("RuntimeError: The current node timed out during startup. This could happen because some of the "
             "Ray processes failed to startup, or the GCS has become overloaded.")


def _node(tmp_path, name: str, log_text: str, alive: bool) -> Node:
    log = tmp_path / f"{name}.log"
    log.write_text(log_text)
    code = "import time; time.sleep(60)" if alive else "raise SystemExit(1)"
    proc = subprocess.Popen([sys.executable, "-c", code])
    if not alive:
        proc.wait()
    return Node(ip="127.0.0.9", proc=proc, temp_dir=str(tmp_path), log=log)


@pytest.fixture
def cluster():
    c = LoopbackCluster(workers=0)
    yield c
    for node in c.workers:
        node.proc.kill()


def test_only_rays_startup_timeout_is_told_apart(tmp_path, cluster):
    with pytest.raises(NodeStartTimedOut):
        cluster.wait_for(_node(tmp_path, "a", TIMED_OUT, alive=False))
    with pytest.raises(RuntimeError) as other:
        cluster.wait_for(_node(tmp_path, "b", "ValueError: a bad --resources string", alive=False))
    assert not isinstance(other.value, NodeStartTimedOut)


def test_a_worker_start_that_timed_out_starts_again_once_on_fresh_ports(tmp_path, cluster, monkeypatch):
    spawned = []

    def spawn(ip, args, name, node_local=None):
        spawned.append(name)
        first = len(spawned) == 1
        return _node(tmp_path, name, TIMED_OUT if first else "Ray runtime started.", alive=not first)

    monkeypatch.setattr(cluster, "_spawn", spawn)
    node = cluster.add_worker(ip="127.0.0.9")
    assert spawned == ["w9", "w9-r1"] and cluster.workers == [node] and node.alive()


def test_a_worker_that_keeps_timing_out_fails(tmp_path, cluster, monkeypatch):
    spawned = []

    def spawn(ip, args, name, node_local=None):
        spawned.append(name)
        return _node(tmp_path, name, TIMED_OUT, alive=False)

    monkeypatch.setattr(cluster, "_spawn", spawn)
    with pytest.raises(NodeStartTimedOut):
        cluster.add_worker(ip="127.0.0.9")
    assert len(spawned) == START_ATTEMPTS and cluster.workers == []


def test_another_start_failure_is_not_retried(tmp_path, cluster, monkeypatch):
    spawned = []

    def spawn(ip, args, name, node_local=None):
        spawned.append(name)
        return _node(tmp_path, name, "ValueError: a bad --resources string", alive=False)

    monkeypatch.setattr(cluster, "_spawn", spawn)
    with pytest.raises(RuntimeError):
        cluster.add_worker(ip="127.0.0.9")
    assert spawned == ["w9"]
