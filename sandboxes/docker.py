"""`DockerSandbox`: run model-written code in Docker containers, one per session, from a warm pool.

Each container starts from a tiny local image (`agentrl-sandbox:base`, imported from a tarball
of empty directories on first use: nothing is pulled) with the host's /usr, the interpreter's
prefix and a few /etc files bind-mounted read-only, a read-only root, tmpfs `/workspace` and
`/tmp`, no network (`network_mode="none"`), no capabilities, `no-new-privileges`, Docker's
default seccomp profile, and cgroup limits on memory (swap included), CPUs and processes. Jobs run
as an unprivileged uid via `docker exec`; the container's init is a root `sleep` that jobs cannot
signal (tini, as PID 1, reaps orphans). After every job, the job's processes are killed from the
host through the container's cgroup; a pooled container is also wiped, and `close` removes the
container with everything in it. The daemon must run on this machine for that kill.

Threats covered: the same list as `agentrl.sandboxes.local` (network, host files, host
environment, fork and memory bombs, runaway CPU and sleeps, output floods, sandboxes seeing each
other, leftovers), plus a seccomp filter on system calls. Not covered: kernel exploits that
survive Docker's seccomp profile (a VM is the answer there), and side channels. Each job costs two
`docker exec` calls (tens of milliseconds), so this backend suits sessions (SWE-style tasks)
better than thousands of short snippets; use `LocalSandbox` for those.

`image=` runs the containers from an image of your own instead, for example a SWE task's image
with the repository at /testbed or data files next to it. It must already be on the daemon (build
it `FROM agentrl-sandbox:base`; `ensure_base_image` makes that one); the host's /usr, interpreter
and /etc files are still bind-mounted over it, so it adds files but does not change the toolchain.

The `docker` package is imported only when a DockerSandbox is made; without it, or without a
daemon, `SandboxUnavailableError` says what to install or start.
"""

from __future__ import annotations

import asyncio
import atexit
import base64
import contextlib
import io
import json
import logging
import os
import posixpath
import socket
import struct
import tarfile
import threading
import time
from collections.abc import Mapping
from typing import Any

from agentrl.errors import SandboxClosedError, SandboxError, SandboxUnavailableError
from agentrl.sandboxes.bwrap import sandbox_python
from agentrl.types import ExecResult

__all__ = ["DockerSandbox", "DockerSession"]

_log = logging.getLogger(__name__)
IMAGE = "agentrl-sandbox:base"
WORKDIR = "/workspace"
JOB_UID = 1000
_ETC = ("ld.so.cache", "ld.so.conf", "ld.so.conf.d", "alternatives", "localtime", "nsswitch.conf",
        "hosts", "protocols", "services", "mime.types", "ssl/certs")
_HEADER = struct.Struct(">I")

# Runs inside the container as the job's uid: reads a header and the job's files from stdin, then
# becomes the job (whose stdin is the rest of the stream), or serves one file read or write.
_BOOT = r"""
import json, os, resource, struct, sys, base64
def read(n):
    out = b""
    while len(out) < n:
        chunk = os.read(0, n - len(out))
        if not chunk:
            break
        out += chunk
    return out
hdr = json.loads(read(struct.unpack(">I", read(4))[0]))
root = os.path.realpath(hdr["workdir"])
def confined(p):
    full = os.path.realpath(os.path.join(root, p))
    if full != root and not full.startswith(root + os.sep):
        sys.stderr.write("PermissionError: %s is outside the work dir\n" % p); os._exit(13)
    return full
os.chdir(root)
for rel, data in hdr.get("files", {}).items():
    path = confined(rel); os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(base64.b64decode(data))
if hdr["op"] == "read":
    path = confined(hdr["path"])
    if not os.path.isfile(path):
        sys.stderr.write("FileNotFoundError: %s\n" % hdr["path"]); os._exit(2)
    with open(path, "rb") as f:
        sys.stdout.buffer.write(f.read())
    sys.stdout.flush()
    os._exit(0)
if hdr["op"] == "write":
    path = confined(hdr["path"]); os.makedirs(os.path.dirname(path), exist_ok=True)
    path = confined(hdr["path"])
    with open(path, "wb") as f:
        while True:
            chunk = os.read(0, 65536)
            if not chunk:
                break
            f.write(chunk)
    os._exit(0)
for name, (soft, hard) in hdr["rlimits"].items():
    resource.setrlimit(getattr(resource, name), (soft, hard))
prog = hdr["program"]
if hdr["kind"] == "shell":
    os.execve("/bin/bash", ["bash", "-c", prog], hdr["env"])
if len(prog) > 100000:
    with open("/tmp/.agentrl_job.py", "w") as f:
        f.write(prog)
    os.execve(hdr["python"], [hdr["python"], "/tmp/.agentrl_job.py"], hdr["env"])
os.execve(hdr["python"], [hdr["python"], "-c", prog], hdr["env"])
"""


def _import_docker() -> Any:
    try:
        import docker
    except ImportError as exc:
        raise SandboxUnavailableError(
            "DockerSandbox needs the Docker SDK: pip install 'agentrl[docker]' (the 'docker' package)."
        ) from exc
    return docker


def _base_image_tar() -> bytes:
    """A root filesystem of empty directories and links into /usr (which is bind-mounted)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for d, mode in (("usr", 0o755), ("etc", 0o755), ("tmp", 0o1777), ("workspace", 0o755),
                        ("proc", 0o555), ("dev", 0o755), ("sys", 0o555), ("root", 0o755),
                        ("sbin", 0o755)):  # a real directory: Docker mounts its init at /sbin/docker-init
            info = tarfile.TarInfo(d)
            info.type, info.mode = tarfile.DIRTYPE, mode
            tar.addfile(info)
        for name in ("bin", "lib", "lib64"):
            if os.path.islink(f"/{name}"):
                info = tarfile.TarInfo(name)
                info.type, info.linkname = tarfile.SYMTYPE, os.readlink(f"/{name}")
                tar.addfile(info)
        for name, text in (("etc/passwd", f"root:x:0:0:root:/root:/bin/sh\nsandbox:x:{JOB_UID}:{JOB_UID}::{WORKDIR}:/bin/bash\n"),
                           ("etc/group", f"root:x:0:\nsandbox:x:{JOB_UID}:\n")):
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o644
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


class _Container:
    """One container and the blocking calls on it (run in threads)."""

    def __init__(self, api: Any, cid: str) -> None:
        self.api = api
        self.id = cid
        self.healthy = True

    def oom_kills(self) -> int:
        path = f"/sys/fs/cgroup/memory/docker/{self.id}/memory.oom_control"
        try:
            with open(path) as f:
                for line in f:
                    if line.startswith("oom_kill "):
                        return int(line.split()[1])
        except (OSError, ValueError):
            pass
        return 0

    def run(self, header: dict[str, Any], tail: bytes, timeout_s: float, max_output: int,
            user: str = f"{JOB_UID}:{JOB_UID}") -> tuple[bytes, bytes, int | None, str | None]:
        """One exec of the boot script; returns stdout, stderr, exit code and why it was killed."""
        body = json.dumps(header).encode()
        data = _HEADER.pack(len(body)) + body + tail
        eid = self.api.exec_create(self.id, [header["python"], "-I", "-c", _BOOT], stdin=True, user=user,
                                   workdir=WORKDIR)["Id"]
        sock = self.api.exec_start(eid, socket=True)
        raw = getattr(sock, "_sock", sock)

        def feed() -> None:
            with contextlib.suppress(OSError):
                raw.sendall(data)
                raw.shutdown(socket.SHUT_WR)

        writer = threading.Thread(target=feed, daemon=True)
        writer.start()
        streams = {1: bytearray(), 2: bytearray()}
        pending = b""
        total = 0
        killed = None
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    killed = "timeout"
                    break
                raw.settimeout(remaining)
                try:
                    chunk = raw.recv(65536)
                except TimeoutError:
                    killed = "timeout"
                    break
                if not chunk:
                    break
                pending += chunk
                while len(pending) >= 8:
                    kind, size = pending[0], struct.unpack(">I", pending[4:8])[0]
                    if len(pending) < 8 + size:
                        break
                    payload, pending = pending[8:8 + size], pending[8 + size:]
                    total += size
                    if kind in streams:
                        streams[kind] += payload[: max(0, max_output - (total - size))]
                if total > max_output:
                    killed = "output"
                    break
        finally:
            with contextlib.suppress(OSError):
                raw.close()
        self.kill_jobs()
        exit_code = None
        for _ in range(100):
            info = self.api.exec_inspect(eid)
            if not info["Running"]:
                exit_code = info["ExitCode"]
                break
            time.sleep(0.01)
        return bytes(streams[1]), bytes(streams[2]), exit_code, killed

    def _cgroup_procs(self) -> str | None:
        for path in (f"/sys/fs/cgroup/pids/docker/{self.id}/cgroup.procs",
                     f"/sys/fs/cgroup/system.slice/docker-{self.id}.scope/cgroup.procs",
                     f"/sys/fs/cgroup/docker/{self.id}/cgroup.procs"):
            if os.path.exists(path):
                return path
        return None

    def kill_jobs(self, wipe: bool = False) -> None:
        """Kill every process of the job's uid; with `wipe`, also empty /workspace, /tmp, /dev/shm.

        The kill is done from the host through the container's cgroup: a `docker exec` cannot be
        relied on while an earlier exec is still flooding its output stream.
        """
        procs = self._cgroup_procs()
        if procs is None:
            eid = self.api.exec_create(self.id, ["/bin/bash", "-c", "kill -9 -1; exit 0"],
                                       user=f"{JOB_UID}:{JOB_UID}")["Id"]
            self.api.exec_start(eid)
        else:
            for _ in range(500):
                victims = []
                with contextlib.suppress(OSError), open(procs) as f:
                    for pid in f.read().split():
                        with contextlib.suppress(OSError, IndexError), open(f"/proc/{pid}/status") as st:
                            uid = next(line for line in st if line.startswith("Uid:")).split()[1]
                            if int(uid) == JOB_UID:
                                victims.append(int(pid))
                if not victims:
                    break
                for pid in victims:
                    with contextlib.suppress(OSError):
                        os.kill(pid, 9)
                time.sleep(0.002)
        if wipe:
            eid = self.api.exec_create(
                self.id, ["/usr/bin/find", WORKDIR, "/tmp", "/dev/shm", "-mindepth", "1", "-delete"],
                user=f"{JOB_UID}:{JOB_UID}")["Id"]
            self.api.exec_start(eid)

    def remove(self) -> None:
        self.healthy = False
        with contextlib.suppress(Exception):
            self.api.remove_container(self.id, force=True, v=True)


class DockerSandbox:
    """Docker-isolated code execution with a warm pool of containers (see the module docstring).

    Args:
        memory_mb: Memory (and memory+swap) limit of one container.
        cpus: CPU share of one container (fractional CPUs).
        max_processes: The container's pids limit.
        max_output_bytes: Stdout plus stderr kept per job; more kills the job ("output").
        pool_size: Warm containers kept ready for one-shot `exec`.
        max_concurrency: Jobs running at once; default one per CPU core. Others wait.
        python: Interpreter to run code with; default this process's base interpreter.
        base_url: Docker daemon address; default from the environment (DOCKER_HOST or the socket).
        image: The containers' image; default `agentrl-sandbox:base` (see the module docstring).
    """

    def __init__(self, *, memory_mb: int = 512, cpus: float = 1.0, max_processes: int = 128,
                 max_output_bytes: int = 1_000_000, pool_size: int = 2, max_concurrency: int | None = None,
                 python: str | None = None, base_url: str | None = None, image: str | None = None) -> None:
        docker = _import_docker()
        try:
            self._client = docker.DockerClient(base_url=base_url) if base_url else docker.from_env()
            self._client.ping()
        except Exception as exc:
            raise SandboxUnavailableError(
                f"No Docker daemon answered ({type(exc).__name__}: {exc}); install and start one "
                "('apt-get install docker.io', then 'dockerd'), or use the 'local' backend."
            ) from exc
        self._api = self._client.api
        self.image = image or IMAGE
        exe, prefix = sandbox_python()
        self.python = python or exe
        self._binds = {"/usr": {"bind": "/usr", "mode": "ro"}}
        if not python and not prefix.startswith("/usr/"):
            self._binds[prefix] = {"bind": prefix, "mode": "ro"}
        for name in _ETC:
            if os.path.exists(f"/etc/{name}"):
                self._binds[f"/etc/{name}"] = {"bind": f"/etc/{name}", "mode": "ro"}
        self.memory_mb = memory_mb
        self.cpus = cpus
        self.max_processes = max_processes
        self.max_output_bytes = max_output_bytes
        self.pool_size = pool_size
        self.max_concurrency = max(1, max_concurrency or os.cpu_count() or 1)
        self._idle: list[_Container] = []
        self._all: set[_Container] = set()
        self._sem: asyncio.Semaphore | None = None
        self._closed = False
        # Containers outlive this process unless removed: remove whatever close() did not.
        atexit.register(self._remove_all_now)
        self._env = {"PATH": f"{os.path.dirname(self.python)}:/usr/local/bin:/usr/bin:/bin", "HOME": WORKDIR,
                     "LANG": "C.UTF-8", "TMPDIR": "/tmp", "USER": "sandbox", "PYTHONDONTWRITEBYTECODE": "1"}

    # ── containers ──────────────────────────────────────────────────────────────────────────
    def ensure_base_image(self) -> None:
        """Import `agentrl-sandbox:base` into the daemon if it is not there (nothing is pulled)."""
        try:
            self._client.images.get(IMAGE)
        except Exception:
            repo, tag = IMAGE.split(":")
            self._api.import_image_from_data(_base_image_tar(), repository=repo, tag=tag)

    def _ensure_image(self) -> None:
        if self.image == IMAGE:
            self.ensure_base_image()
            return
        try:
            self._client.images.get(self.image)
        except Exception as exc:
            raise SandboxUnavailableError(
                f"The Docker image {self.image!r} is not on this daemon ({type(exc).__name__}); agentrl pulls "
                "nothing: build it locally, FROM agentrl-sandbox:base (DockerSandbox().ensure_base_image() makes that)."
            ) from exc

    def _start_container(self) -> _Container:
        self._ensure_image()
        mb = self.memory_mb
        container = self._client.containers.run(
            self.image, ["/usr/bin/sleep", "infinity"], detach=True, network_mode="none", volumes=self._binds,
            read_only=True, working_dir=WORKDIR, environment={"PATH": "/usr/bin:/bin"},
            tmpfs={WORKDIR: f"size={mb}m,uid={JOB_UID},gid={JOB_UID},mode=755", "/tmp": f"size={mb}m,mode=1777",
                   "/dev/shm": f"size={mb}m,mode=1777"},
            mem_limit=f"{mb}m", memswap_limit=f"{mb}m", nano_cpus=int(self.cpus * 1e9),
            pids_limit=self.max_processes, cap_drop=["ALL"], security_opt=["no-new-privileges"],
            labels={"agentrl.sandbox": "1", "agentrl.owner_pid": str(os.getpid())}, init=True,
        )
        c = _Container(self._api, container.id)
        self._all.add(c)
        return c

    async def _take(self) -> _Container:
        if self._closed:
            raise SandboxClosedError("This DockerSandbox is closed; create a new one.")
        if self._idle:
            return self._idle.pop()
        try:
            return await asyncio.to_thread(self._start_container)
        except Exception as exc:
            raise SandboxError(f"Docker could not start a sandbox container: {exc}") from exc

    async def _release(self, c: _Container, keep: bool) -> None:
        if keep and c.healthy and not self._closed and len(self._idle) < self.pool_size:
            self._idle.append(c)
        else:
            self._all.discard(c)
            await asyncio.to_thread(c.remove)

    async def start(self) -> None:
        """Warm the pool now."""
        started = await asyncio.gather(*(asyncio.to_thread(self._start_container)
                                         for _ in range(self.pool_size - len(self._idle))))
        self._idle.extend(started)

    # ── jobs ────────────────────────────────────────────────────────────────────────────────
    def _job(self, command: str | None, code: str | None, timeout_s: float, stdin: str | bytes | None,
             files: Mapping[str, str | bytes] | None) -> tuple[dict[str, Any], bytes]:
        if (command is None) == (code is None):
            raise ValueError("Pass exactly one of `command` (a shell command) or `code` (Python source).")
        if not (isinstance(timeout_s, (int, float)) and timeout_s > 0):
            raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}.")
        encoded = {}
        for path, data in (files or {}).items():
            norm = posixpath.normpath(path)
            if norm.startswith(("/", "../")) or norm == "..":
                raise ValueError(f"Path {path!r} is outside the sandbox work dir; use a relative path.")
            encoded[norm] = base64.b64encode(data.encode() if isinstance(data, str) else bytes(data)).decode()
        cpu = int(timeout_s) + 2
        header = {"op": "exec", "kind": "shell" if command is not None else "python",
                  "program": command if command is not None else code, "files": encoded, "workdir": WORKDIR,
                  "python": self.python, "env": self._env,
                  "rlimits": {"RLIMIT_CPU": [cpu, cpu + 1], "RLIMIT_CORE": [0, 0], "RLIMIT_FSIZE": [64 << 20, 64 << 20]}}
        tail = stdin.encode() if isinstance(stdin, str) else bytes(stdin or b"")
        return header, tail

    async def _run(self, c: _Container, header: dict[str, Any], tail: bytes, timeout_s: float,
                   wipe: bool) -> ExecResult:
        oom_before = c.oom_kills()
        start = time.monotonic()
        try:
            out, err, code, killed = await asyncio.to_thread(c.run, header, tail, timeout_s, self.max_output_bytes)
            if wipe:
                await asyncio.to_thread(c.kill_jobs, True)
        except Exception as exc:
            c.healthy = False
            raise SandboxError(f"Docker failed to run the job: {type(exc).__name__}: {exc}") from exc
        duration = time.monotonic() - start
        if killed is None and code is not None and code > 128:
            # Docker reports a signal death as 128 + signal; report it as -signal, like `local`.
            sig = code - 128
            if sig == 9 and c.oom_kills() > oom_before:
                killed = "memory"
            elif sig == 24:  # SIGXCPU from RLIMIT_CPU
                killed = "cpu"
            else:
                killed = "signal"
            code = -sig
        return ExecResult(out.decode(errors="replace"), err.decode(errors="replace"),
                          None if killed in ("timeout", "output") else code, killed == "timeout", killed, duration)

    async def exec(self, command: str | None = None, *, code: str | None = None, timeout_s: float,
                   stdin: str | bytes | None = None, files: Mapping[str, str | bytes] | None = None) -> ExecResult:
        """Run one job in a clean container; see `Sandbox.exec`."""
        header, tail = self._job(command, code, timeout_s, stdin, files)
        if self._sem is None:
            self._sem = asyncio.Semaphore(self.max_concurrency)
        async with self._sem:
            c = await self._take()
            keep = False
            try:
                result = await self._run(c, header, tail, timeout_s, wipe=True)
                keep = True
            finally:
                await self._release(c, keep)
        return result

    async def session(self) -> DockerSession:
        """A container of your own whose files persist across `exec` calls until `close()`."""
        return DockerSession(self, await self._take())

    async def close(self) -> None:
        """Remove every container this sandbox started. Closing twice is a no-op."""
        if self._closed:
            return
        self._closed = True
        self._idle.clear()
        await asyncio.gather(*(asyncio.to_thread(c.remove) for c in list(self._all)))
        self._all.clear()

    async def is_alive(self) -> bool:
        return not self._closed

    def _remove_all_now(self) -> None:
        for c in list(self._all):
            c.remove()
        self._all.clear()


class DockerSession:
    """One container kept for a multi-step task; see `SandboxSession`."""

    def __init__(self, owner: DockerSandbox, container: _Container) -> None:
        self._owner = owner
        self._c: _Container | None = container
        self._lock = asyncio.Lock()

    @property
    def container_id(self) -> str | None:
        return self._c.id if self._c else None

    def _live(self) -> _Container:
        if self._c is None:
            raise SandboxClosedError("This docker session is closed; open a new one.")
        return self._c

    async def exec(self, command: str | None = None, *, code: str | None = None, timeout_s: float,
                   stdin: str | bytes | None = None, files: Mapping[str, str | bytes] | None = None) -> ExecResult:
        header, tail = self._owner._job(command, code, timeout_s, stdin, files)
        async with self._lock:
            return await self._owner._run(self._live(), header, tail, timeout_s, wipe=False)

    async def _file(self, op: str, path: str, data: bytes = b"") -> bytes:
        norm = posixpath.normpath(path)
        if norm.startswith(WORKDIR + "/"):
            norm = norm[len(WORKDIR) + 1:]
        if not path or norm.startswith(("/", "../")) or norm == "..":
            raise ValueError(f"Path {path!r} is outside the sandbox work dir {WORKDIR}; use a relative path.")
        header = {"op": op, "path": norm, "workdir": WORKDIR, "python": self._owner.python}
        async with self._lock:
            c = self._live()
            out, err, code, _ = await asyncio.to_thread(c.run, header, data, 60, 1 << 30)
        text = err.decode(errors="replace").strip()
        if code == 2:
            raise FileNotFoundError(f"{path}: {text}")
        if code == 13:
            raise PermissionError(f"{path}: {text}")
        if code != 0:
            raise OSError(f"{path}: {text or f'exit code {code}'}")
        return out

    async def read_file(self, path: str) -> bytes:
        return await self._file("read", path)

    async def write_file(self, path: str, data: str | bytes) -> None:
        await self._file("write", path, data.encode() if isinstance(data, str) else bytes(data))

    async def close(self) -> None:
        c, self._c = self._c, None
        if c is not None:
            self._owner._all.discard(c)
            await asyncio.to_thread(c.remove)

    async def is_alive(self) -> bool:
        return self._c is not None and self._c.healthy
