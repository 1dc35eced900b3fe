"""A real multi-node Ray cluster on one machine: a head on 127.0.0.2 and worker nodes on 127.0.0.3, ...

Each node is its own ``ray start --block`` (own raylet, object store, node id, resources), started
with ``--node-ip-address`` on a loopback address, free ports and one auth token shared by every
node and driver (Ray 2.60 turns token authentication on for ``ray start``). Any 127.0.0.0/8 address
is local, so nothing leaves the machine. Only the processes this helper started are ever signalled:
a node is stopped by the pid of its ``ray start --block`` (whose SIGTERM handler ends the node's
processes), never by ``ray stop``, which would end every Ray of the user on the machine.

    with LoopbackCluster(workers=1) as c:        # head 127.0.0.2 + worker 127.0.0.3 (HEAD_IP says why not .1)
        c.connect()                              # ray.init as a driver on the head's address
        c.add_worker()                           # 127.0.0.4 joins
        c.kill_raylet(c.workers[0])              # SIGKILL that node's raylet: the node dies
        c.add_worker(ip="127.0.0.3")             # ... and it comes back on its address (a new Ray node)
        c.kill_node(c.workers[-1])               # SIGKILL every process of a node (a lost machine)

Usable by hand too: ``python tests/loopback_cluster.py 1`` starts a head and one worker node,
prints the environment a client needs and stops them on Ctrl-C.
"""

from __future__ import annotations

import ipaddress
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

START_TIMEOUT_S = 120
# A worker's `ray start` that gives up with Ray's "timed out during startup" (its GCS answered too
# slowly: seen once on a loaded 2-core CI machine) is started again, once, on fresh ports. Only that
# exit is retried; any other start failure, and every test, fails as it is.
START_ATTEMPTS = 2
STARTUP_TIMED_OUT = "timed out during startup"
# Not 127.0.0.1: Ray replaces "127.0.0.1"/"localhost" given as a node or driver address with the
# machine's interface address (ray._private.services.resolve_ip_for_localhost), so a head "on
# 127.0.0.1" would advertise a non-loopback address. Any other 127.x address is taken as given.
HEAD_IP = "127.0.0.2"
STOP_TIMEOUT_S = 30


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind((host, 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def process_token() -> str:
    """The auth token this process's Ray client uses, else a new one.

    Ray loads a process's token once (RAY_AUTH_TOKEN, else ~/.ray/auth_token, which a plain local
    ray.init creates) and keeps it: a process that has been a driver of a local Ray can join another
    cluster only if that cluster has the same token. So the cluster takes the process's token."""
    if os.environ.get("RAY_AUTH_TOKEN"):
        return os.environ["RAY_AUTH_TOKEN"]
    default = Path.home() / ".ray" / "auth_token"
    if default.is_file() and default.read_text().strip():
        return default.read_text().strip()
    return secrets.token_hex(16)


def is_loopback(address: str) -> bool:
    return ipaddress.ip_address(address).is_loopback


@dataclass
class Node:
    ip: str
    proc: subprocess.Popen
    temp_dir: str
    log: Path
    head: bool = False
    ports: dict[str, int] = field(default_factory=dict)
    cwd: Path | None = None

    def alive(self) -> bool:
        return self.proc.poll() is None

    def processes(self) -> list[psutil.Process]:
        """The node's live processes: its `ray start --block` and everything below it."""
        try:
            root = psutil.Process(self.proc.pid)
            return [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def raylet(self) -> psutil.Process:
        for p in self.processes():
            try:
                if p.name() == "raylet" or "/raylet" in " ".join(p.cmdline()[:1]):
                    return p
            except psutil.NoSuchProcess:
                continue
        raise AssertionError(f"no raylet among the processes of node {self.ip} (see {self.log})")


class NodeStartTimedOut(RuntimeError):
    """`ray start` exited with Ray's startup timeout (the GCS too slow to answer)."""


class LoopbackCluster:
    """Start/stop a head and worker nodes on loopback addresses; see the module docstring."""

    def __init__(self, workers: int = 1, head_cpus: int = 1, worker_cpus: int = 1, dashboard: bool = True,
                 env: dict[str, str] | None = None):
        self.token = process_token()
        self.head_cpus, self.worker_cpus, self.dashboard = head_cpus, worker_cpus, dashboard
        self.n_workers = workers
        self.base_env = {**os.environ, **(env or {})}
        self.base_env.pop("RAY_ADDRESS", None)
        self.base_env.update({
            "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": self.token,
            # A node whose raylet dies is declared dead after ~3 missed 1-s health checks (default
            # 5 missed 3-s checks), so a node-death test waits seconds, not half a minute.
            "RAY_health_check_period_ms": "1000", "RAY_health_check_failure_threshold": "3",
            "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "2",  # nothing to drain when a test stops a node
        })
        # Ray's unix socket paths under the temp dir must stay below ~107 bytes: short names under /tmp.
        self.root = Path(tempfile.mkdtemp(prefix="e3mn", dir="/tmp"))
        self.head: Node | None = None
        self.workers: list[Node] = []
        self._next_ip = 3
        self._gcs_port = 0
        self._dashboard_port = 0

    # ------------------------------------------------------------ addresses and client env

    @property
    def address(self) -> str:
        return f"{HEAD_IP}:{self._gcs_port}"

    @property
    def job_api(self) -> str:
        return f"http://127.0.0.1:{self._dashboard_port}"

    def client_env(self) -> dict[str, str]:
        """The environment of a client (driver, `ray job submit`, CLI run) of this cluster."""
        return {**self.base_env, "RAY_ADDRESS": self.address, "RAY_JOB_API": self.job_api,
                "RAY_GCS": self.address, "EAGLE3_RAY_NODE_IP": HEAD_IP}

    # ------------------------------------------------------------ start / stop

    def __enter__(self) -> "LoopbackCluster":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> "LoopbackCluster":
        try:
            self._start_head()
            for _ in range(self.n_workers):
                self.add_worker()
        except BaseException:
            self.stop()
            raise
        return self

    def _spawn(self, ip: str, args: list[str], name: str, node_local: Path | None = None) -> Node:
        temp_dir = str(self.root / name)
        os.makedirs(temp_dir, exist_ok=True)
        # Each node's processes (raylet, workers) run in a directory of their own: a path under
        # /proc/self/cwd/ is then a per-node path, the same string naming a different directory on
        # each node, as a node-local disk would (test_multinode.py's shared-storage check).
        cwd = self.root / f"{name}-cwd"
        cwd.mkdir(exist_ok=True)
        log = self.root / f"{name}.log"
        metrics, agent, agent_grpc, runtime_env, om, nm = free_ports(6, ip)
        ports = dict(metrics=metrics, agent=agent, agent_grpc=agent_grpc, runtime_env=runtime_env,
                     object_manager=om, node_manager=nm)
        cmd = ["ray", "start", "--block", "--node-ip-address", ip, "--temp-dir", temp_dir,
               "--disable-usage-stats", "--metrics-export-port", str(metrics),
               "--dashboard-agent-listen-port", str(agent), "--dashboard-agent-grpc-port", str(agent_grpc),
               "--runtime-env-agent-port", str(runtime_env), "--object-manager-port", str(om),
               "--node-manager-port", str(nm), *args]
        if node_local is not None:
            # Its own user and mount namespace with an empty tmpfs over node_local: this node sees
            # another (empty) directory at that path than the other nodes do, as with a node-local
            # disk mounted at the same path. `sh` execs `ray start`: the pid stays the node's.
            node_local.mkdir(parents=True, exist_ok=True)
            cmd = ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c",
                   'mount -t tmpfs tmpfs "$0" && exec "$@"', str(node_local), *cmd]
        with open(log, "ab") as f:
            # A driver started on this node (a `ray job submit` entrypoint) joins as this address.
            proc = subprocess.Popen(cmd, env={**self.base_env, "EAGLE3_RAY_NODE_IP": ip}, stdout=f, stderr=subprocess.STDOUT, cwd=cwd,
                                    start_new_session=True)
        return Node(ip=ip, proc=proc, temp_dir=temp_dir, log=log, head=name == "head", ports=ports, cwd=cwd)

    def _start_head(self) -> None:
        gcs, dash, client = free_ports(3)
        self._gcs_port, self._dashboard_port = gcs, dash
        args = ["--head", "--port", str(gcs), "--num-cpus", str(self.head_cpus),
                "--ray-client-server-port", str(client),
                "--include-dashboard", "true" if self.dashboard else "false"]
        if self.dashboard:
            args += ["--dashboard-host", "127.0.0.1", "--dashboard-port", str(dash)]
        self.head = self._spawn(HEAD_IP, args, "head")
        self.wait_for(self.head)

    def add_worker(self, num_cpus: int | None = None, resources: str | None = None, wait: bool = True,
                   ip: str | None = None, node_local: Path | None = None) -> Node:
        """Start a worker node on the next loopback address (127.0.0.3, 127.0.0.4, ...), or on ``ip``
        (a node that died coming back on its address: a new Ray node, with a new node id).
        ``node_local``: a directory that this node alone sees as another, empty one (see _spawn)."""
        if ip is None:
            ip = f"127.0.0.{self._next_ip}"
            self._next_ip += 1
        name = f"w{ip.rsplit('.', 1)[1]}"
        earlier = sum(w.ip == ip for w in self.workers)
        name += f"-{earlier}" if earlier else ""
        args = ["--address", self.address, "--num-cpus", str(self.worker_cpus if num_cpus is None else num_cpus)]
        if resources:
            args += ["--resources", resources]
        for attempt in range(START_ATTEMPTS):
            node = self._spawn(ip, args, name + (f"-r{attempt}" if attempt else ""), node_local=node_local)
            self.workers.append(node)
            if not wait:
                return node
            try:
                self.wait_for(node)
                return node
            except NodeStartTimedOut as e:
                self.workers.remove(node)
                self.stop_node(node)
                if attempt + 1 == START_ATTEMPTS:
                    raise
                print(f"[loopback_cluster] {e}; starting {ip} again", file=sys.stderr, flush=True)
        raise AssertionError("unreachable")

    def wait_for(self, node: Node) -> None:
        """Wait for `ray start` to report the node up (its log line; no extra driver needed)."""
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if not node.alive():
                log = node.log.read_text(errors="replace")
                kind = NodeStartTimedOut if STARTUP_TIMED_OUT in log else RuntimeError
                raise kind(f"ray start for {node.ip} exited ({node.proc.returncode}); log:\n" + log[-3000:])
            if "Ray runtime started" in node.log.read_text(errors="replace"):
                return
            time.sleep(0.5)
        raise RuntimeError(f"node {node.ip} did not start within {START_TIMEOUT_S}s; see {node.log}")

    def kill_raylet(self, node: Node) -> int:
        """SIGKILL the node's raylet (the node dies as a machine would); returns its pid."""
        raylet = node.raylet()
        raylet.send_signal(signal.SIGKILL)
        return raylet.pid

    def kill_node(self, node: Node) -> list[int]:
        """SIGKILL every process of the node at once (its `ray start`, raylet, agents, workers), as
        a machine that is lost; returns their pids."""
        procs = node.processes()
        for p in procs:
            try:
                p.send_signal(signal.SIGKILL)
            except psutil.NoSuchProcess:
                continue
        return [p.pid for p in procs]

    def stop_node(self, node: Node) -> None:
        procs = node.processes()
        if node.alive():
            node.proc.send_signal(signal.SIGTERM)
            try:
                node.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                pass
        for p in procs:  # what SIGTERM left behind, by the pids recorded before it
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        if node.proc.poll() is None:
            node.proc.wait(STOP_TIMEOUT_S)

    def stop(self) -> None:
        for node in reversed(self.workers):
            self.stop_node(node)
        if self.head is not None:
            self.stop_node(self.head)

    # ------------------------------------------------------------ drivers

    def connect(self, **kwargs):
        """ray.init as a driver of this cluster on the head's address, with the cluster's token."""
        os.environ.update({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": self.token})
        import ray

        ray.init(address=self.address, _node_ip_address=HEAD_IP, **kwargs)
        return ray


def non_loopback_nodes(nodes: list[dict]) -> list[str]:
    """Addresses in ray.nodes() that are not loopback (must be empty)."""
    return [n["NodeManagerAddress"] for n in nodes if not is_loopback(n["NodeManagerAddress"])]


if __name__ == "__main__":
    cluster = LoopbackCluster(workers=int(sys.argv[1]) if len(sys.argv) > 1 else 1).start()
    env = cluster.client_env()
    print(f"RAY_ADDRESS={env['RAY_ADDRESS']} RAY_AUTH_MODE=token RAY_AUTH_TOKEN={cluster.token} "
          f"job server {cluster.job_api}; nodes: {[n.ip for n in [cluster.head, *cluster.workers]]}")
    try:
        signal.pause()
    except KeyboardInterrupt:
        pass
    finally:
        cluster.stop()
