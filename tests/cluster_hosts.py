"""A Ray cluster of two hosts built on this machine, for the multi-host tests: `NamespaceCluster`.

Each host is a network namespace (`ip netns`) joined to the other by a veth pair with private
addresses (10.77.0.1 for the head, 10.77.0.2 for the worker; nothing else is routed), and a mount
and UTS namespace of its own (`unshare -m -u`): a private /tmp (a fresh directory on this
machine's disk, bind-mounted: on a tmpfs the models, weights and checkpoints a run writes would
take the memory its processes need), a private tmpfs on /dev/shm, a working directory `/tmp/work`
inside /tmp, and its own host name. So the hosts share nothing but the
read-only code under /work and the python install: a file one host writes in /tmp (a run
directory, Ray's session files, weights) is not there for the other, and a process on one host
reaches the other only over the veth. A small keeper process (`sleep infinity`) holds each host's
namespaces; commands run in a host with `nsenter` into the keeper's namespaces (`Host.run`,
`Host.popen`).

The head runs `ray start --head --node-ip-address=10.77.0.1`, the worker `ray start
--address=10.77.0.1:PORT`, both with Ray's token authentication on as the README's "Run on a
cluster" says: every process run in a host has `RAY_AUTH_MODE=token`, the head generates the token
(`ray get-auth-token --generate`, into its HOME's `.ray/auth_token`) and it is copied to the same
place on the worker.

Needs root and `ip netns`; `NamespaceCluster.unavailable()` says why not, for a skip. `stop()`
stops Ray on each host, kills what is left in the hosts' namespaces (by pid, only processes of
these namespaces), and deletes the namespaces (which takes the veth pair with them).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

__all__ = ["Host", "NamespaceCluster"]

SUBNET = "10.77.0"
RAY_PORT = 6379
WORKDIR = "/tmp/work"
TOKEN_FILE = f"{WORKDIR}/.ray/auth_token"  # ~/.ray/auth_token: each host's HOME is WORKDIR


def _sh(*argv: str, check: bool = True, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), capture_output=True, text=True, check=check, timeout=timeout)


@dataclass
class Host:
    """One simulated machine: its network namespace, address, and the keeper holding its namespaces."""

    name: str
    netns: str
    ip: str
    env: dict[str, str] = field(default_factory=dict)
    keeper: subprocess.Popen[bytes] | None = None
    root: str = ""  # the directory on this machine's disk that is the host's /tmp

    @property
    def workdir(self) -> str:
        return WORKDIR

    def _prefix(self) -> list[str]:
        assert self.keeper is not None, f"host {self.name} is not started"
        return [
            "nsenter",
            "-t",
            str(self.keeper.pid),
            "-n",
            "-m",
            "-u",
            "--wd",
            "--",
        ]  # the keeper's cwd: WORKDIR

    def _env(self, extra: dict[str, str] | None) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
        env.update({"TMPDIR": "/tmp", "RAY_TMPDIR": "/tmp/ray", "HOME": WORKDIR, **self.env, **(extra or {})})
        return env

    def run(
        self,
        argv: list[str],
        *,
        env: dict[str, str] | None = None,
        timeout: float = 300.0,
        check: bool = True,
    ) -> subprocess.CompletedProcess[str]:
        """Run `argv` in this host (its network, mounts, working directory) and wait for it."""
        proc = subprocess.run(
            self._prefix() + argv, capture_output=True, text=True, env=self._env(env), timeout=timeout
        )
        if check and proc.returncode != 0:
            raise RuntimeError(
                f"on {self.name}: {' '.join(argv)} exited {proc.returncode}\n"
                f"stdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-6000:]}"
            )
        return proc

    def popen(
        self, argv: list[str], *, env: dict[str, str] | None = None, **kwargs: object
    ) -> subprocess.Popen[str]:
        """Start `argv` in this host without waiting (a driver the test watches or kills)."""
        return subprocess.Popen(
            self._prefix() + argv,
            env=self._env(env),
            text=True,  # type: ignore[call-overload]
            **kwargs,
        )

    def python(self, code: str, **kwargs: object) -> subprocess.CompletedProcess[str]:
        """Run python `code` in this host with the test's interpreter."""
        return self.run([sys.executable, "-c", code], **kwargs)  # type: ignore[arg-type]

    def write(self, path: str, text: str) -> None:
        """Write `text` to `path` in this host's file system."""
        self.run(
            [
                sys.executable,
                "-c",
                "import pathlib, sys; pathlib.Path(sys.argv[1]).write_text(sys.argv[2])",
                path,
                text,
            ]
        )

    def pids(self) -> list[int]:
        """Every process in this host's network namespace."""
        out = _sh("ip", "netns", "pids", self.netns, check=False).stdout
        return [int(p) for p in out.split()]


class NamespaceCluster:
    """Two hosts (head, worker) on one machine with a Ray cluster across them (see the module docstring)."""

    def __init__(self, tag: str | None = None, *, cpus: int = 2, memory_gb: float = 6.0) -> None:
        tag = tag or f"{os.getpid() % 100000}"
        self.tag = tag
        self.cpus = cpus
        self.memory_gb = memory_gb
        self.token = ""  # generated on the head by `start`
        env = {
            "RAY_AUTH_MODE": "token",
            "RAY_USAGE_STATS_ENABLED": "0",
            "PYTHONUNBUFFERED": "1",
        }
        self.head = Host("head", f"arl-head-{tag}", f"{SUBNET}.1", dict(env))
        self.worker = Host("worker", f"arl-work-{tag}", f"{SUBNET}.2", dict(env))
        self.hosts = [self.head, self.worker]
        self.veth = (f"arlh{tag}"[:15], f"arlw{tag}"[:15])
        self.started = False

    @property
    def address(self) -> str:
        """The Ray head's GCS address, as a driver on either host gives it to `ray.init`."""
        return f"{self.head.ip}:{RAY_PORT}"

    @staticmethod
    def unavailable() -> str | None:
        """Why this machine cannot build the cluster (None when it can)."""
        if os.geteuid() != 0:
            return "building network namespaces needs root"
        for tool in ("ip", "nsenter", "unshare"):
            if shutil.which(tool) is None:
                return f"'{tool}' is not installed"
        probe = f"arl-probe-{os.getpid()}"
        made = _sh("ip", "netns", "add", probe, check=False)
        if made.returncode != 0:
            return f"'ip netns add' failed: {made.stderr.strip()}"
        _sh("ip", "netns", "del", probe, check=False)
        return None

    # ── building ──────────────────────────────────────────────────────────────────────────────
    def start(self, timeout_s: float = 180.0, *, ray: bool = True) -> NamespaceCluster:
        """Build the hosts, then (unless `ray=False`: two hosts and nothing running on them) Ray across them."""
        try:
            self._network()
            for host in self.hosts:
                self._keep(host)
            # as the README says: generate the token on the head, copy it to every other node
            self.head.run([sys.executable, "-m", "ray.scripts.scripts", "get-auth-token", "--generate"])
            self.token = self.head.run(["cat", TOKEN_FILE]).stdout.strip()
            self.worker.run(["mkdir", "-p", f"{WORKDIR}/.ray"])
            self.worker.write(TOKEN_FILE, self.token)
            if ray:
                self._ray(timeout_s)
        except BaseException:
            self.stop()
            raise
        self.started = True
        return self

    def _network(self) -> None:
        a, b = self.veth
        for host in self.hosts:
            _sh("ip", "netns", "add", host.netns)
            _sh("ip", "-n", host.netns, "link", "set", "lo", "up")
        _sh("ip", "link", "add", a, "type", "veth", "peer", "name", b)
        for dev, host in ((a, self.head), (b, self.worker)):
            _sh("ip", "link", "set", dev, "netns", host.netns)
            _sh("ip", "-n", host.netns, "addr", "add", f"{host.ip}/24", "dev", dev)
            _sh("ip", "-n", host.netns, "link", "set", dev, "up")

    def _keep(self, host: Host) -> None:
        host.root = tempfile.mkdtemp(prefix=f"arl-{self.tag}-{host.name}-", dir="/var/tmp")
        script = (
            f"mount --bind {host.root} /tmp && mount -t tmpfs -o size=8g tmpfs /dev/shm && "
            f"mkdir -p {WORKDIR} && cd {WORKDIR} && hostname {host.name} && echo ready && exec sleep infinity"
        )
        host.keeper = subprocess.Popen(
            [
                "ip",
                "netns",
                "exec",
                host.netns,
                "unshare",
                "--mount",
                "--uts",
                "--propagation",
                "private",
                "--",
                "sh",
                "-c",
                script,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        assert host.keeper.stdout is not None
        line = host.keeper.stdout.readline().decode().strip()
        if line != "ready":
            err = host.keeper.stderr.read().decode() if host.keeper.stderr else ""
            raise RuntimeError(f"host {host.name} did not start: {line} {err}")
        # The keeper is `sleep` now (exec), in the namespaces `nsenter -t` enters; ip netns exec
        # made the mount namespace, unshare its own private one inside it.
        deadline = time.monotonic() + 10
        while _target_ns(host.keeper.pid) == _target_ns(os.getpid()) and time.monotonic() < deadline:
            time.sleep(0.05)

    def _ray(self, timeout_s: float) -> None:
        ray_cli = [sys.executable, "-m", "ray.scripts.scripts"]
        common = [
            "--num-cpus",
            str(self.cpus),
            "--memory",
            str(int(self.memory_gb * 2**30)),
            "--object-store-memory",
            str(500 * 2**20),
            "--disable-usage-stats",
            "--temp-dir",
            "/tmp/ray",
        ]
        self.head.run(
            ray_cli
            + [
                "start",
                "--head",
                "--node-ip-address",
                self.head.ip,
                "--port",
                str(RAY_PORT),
                "--include-dashboard=false",
                *common,
            ],
            timeout=timeout_s,
        )
        self.worker.run(
            ray_cli + ["start", "--address", self.address, "--node-ip-address", self.worker.ip, *common],
            timeout=timeout_s,
        )
        deadline = time.monotonic() + timeout_s
        while True:
            alive = self.head.python(
                f"import ray; ray.init(address={self.address!r}, logging_level='ERROR'); "
                "print(sum(1 for n in ray.nodes() if n['Alive']))",
                check=False,
            )
            if alive.returncode == 0 and alive.stdout.strip().splitlines()[-1:] == ["2"]:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"the Ray cluster did not reach 2 nodes in {timeout_s:.0f} s:\n"
                    f"{alive.stdout[-2000:]}\n{alive.stderr[-4000:]}"
                )
            time.sleep(1.0)

    # ── tearing down ──────────────────────────────────────────────────────────────────────────
    def stop(self) -> None:
        """Stop Ray on both hosts, end every process left in them, delete the namespaces."""
        # Not `ray stop`: it finds Ray's processes by name machine-wide (the hosts share the PID
        # namespace), so it would also end every other Ray instance on this machine. Every process
        # of a host is in its network namespace: end those, politely first.
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for host in self.hosts:
                for pid in host.pids():
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, sig)
            if sig == signal.SIGTERM:
                time.sleep(1.0)
        for host in self.hosts:
            if host.keeper is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    host.keeper.wait(timeout=10)
            _sh("ip", "netns", "del", host.netns, check=False)
            if host.root:
                shutil.rmtree(host.root, ignore_errors=True)
        with contextlib.suppress(Exception):  # gone with the namespace already, unless moving it failed
            _sh("ip", "link", "del", self.veth[0], check=False)
        self.started = False

    def __enter__(self) -> NamespaceCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _target_ns(pid: int) -> str:
    with contextlib.suppress(OSError):
        return os.readlink(f"/proc/{pid}/ns/mnt")
    return ""


def _main() -> None:  # python tests/cluster_hosts.py: build it, show it, tear it down
    with NamespaceCluster() as cluster:
        out = cluster.head.python(
            f"import ray; ray.init(address={cluster.address!r}); print(ray.cluster_resources()); "
            "print([n['NodeManagerAddress'] for n in ray.nodes()])"
        )
        print(out.stdout)


if __name__ == "__main__":
    _main()
