"""`DockerSandbox`: run model-written code in Docker containers, one per session, from warm pools.

Two kinds of image:

- **An image of your own** (`image=`, or `session(image=...)`: a SWE-bench, SWE-Gym, SWE-smith or
  R2E-Gym instance image, any Debian, Alpine or distroless-with-a-shell image) runs **as it is**:
  its own /usr, Python (or none), packages and repository. Nothing of the host is mounted into
  it. Everything agentrl does inside needs only `/bin/sh` and coreutils (`cat`, `readlink`,
  `dirname`, `mkdir`, `rm`, `sleep`): commands run through `docker exec` (bash when the image has
  it, else sh), file reads and writes go through `cat` with the path checked by `readlink -f`,
  Python code runs with the image's `python3`/`python`. A session's work dir is the image's
  repository (`workdir=`, e.g. /testbed) on the container's writable layer, so editable installs
  and absolute paths of the image keep working; one-shot `exec` containers get a read-only root
  and a tmpfs work dir, wiped between jobs.
- **The host's userland** (no `image`): a tiny local image (`agentrl-sandbox:base`, imported from
  a tarball of empty directories on first use) with the host's /usr, interpreter prefix and a few
  /etc files bind-mounted read-only, a read-only root and a tmpfs `/workspace`, so code runs with
  the host's Python and packages (what the `retool` env's Python tool wants).

Every container has no network (`network_mode="none"`, loopback only), no capabilities (root in
the container cannot chown others' files, bypass permissions, trace or signal other users'
processes), `no-new-privileges`, Docker's default seccomp profile, and cgroup limits on memory
(swap included), CPUs and processes; jobs also get RLIMIT_CPU, a core size of 0 and a file-size
limit of about 64 MiB. Jobs run as the image's user (root for SWE images; uid 1000 on the host
userland). The container's init (Docker's tini) and its `sleep` run as uid 65534, which jobs
cannot signal or trace, so a job cannot stop its own container. After every job the job's
processes are killed (from the host through the container's cgroup, or with `kill -9 -1` as the
job's user when the daemon is remote), and `close` removes the container with its writable layer.
Containers are labelled with their owner and removed by a watchdog when the owning process dies,
even by SIGKILL, and by a reaper at the next start (`agentrl.sandboxes.docker_reaper`).

Threats covered: network egress, host files and host environment (the host's files are absent,
or read-only and limited to /usr, the interpreter and a few /etc files on the host userland),
fork and memory bombs, runaway CPU and sleeps, output floods, sandboxes seeing each other's files
and processes, leftovers. Not covered: kernel exploits that survive Docker's seccomp profile (a
VM is the answer there), side channels, and disk: a session's writable layer is not size-limited
(overlay2 quotas need xfs), only single files are; `/tmp` and one-shot work dirs are tmpfs sized
like the memory limit. Jobs of a session run as the image's user and may change anything of the
container's own image (that is the point of a SWE task); file access through `read_file` and
`write_file` is confined to the work dir, shell commands are not.

Each job costs two or three `docker exec` calls (tens of milliseconds) and a container start is
about half a second, so this backend suits sessions (SWE-style tasks); the pool keeps `pool_size`
started containers per image and work dir ready (sharing the image's layers, nothing is copied).
The pool follows the data: the sandbox's own image (one-shot jobs and sessions in it) is kept warm,
but another image (one per instance in SWE data) is warmed only for the sessions announced with
`expect(image, n)` and not yet taken, so an eval of N one-image instances starts N containers and
keeps none idle; `max_idle` caps the idle containers of all images together.
The `docker` package is imported only when a DockerSandbox is made; without it, or without a
daemon, `SandboxUnavailableError` says what to install or start.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import io
import logging
import os
import posixpath
import socket
import struct
import tarfile
import threading
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from agentrl.errors import SandboxClosedError, SandboxError, SandboxUnavailableError
from agentrl.sandboxes.bwrap import sandbox_python
from agentrl.sandboxes.docker_reaper import import_docker_sdk, owner_labels, reap_orphans, start_watchdog
from agentrl.types import ExecResult

__all__ = ["IMAGE", "DockerSandbox", "DockerSession"]

_log = logging.getLogger(__name__)
IMAGE = "agentrl-sandbox:base"
"""The host-userland image (see the module docstring)."""
WORKDIR = "/workspace"
JOB_UID = 1000
KEEPER_UID = 65534
_ETC = ("ld.so.cache", "ld.so.conf", "ld.so.conf.d", "alternatives", "localtime", "nsswitch.conf",
        "hosts", "protocols", "services", "mime.types", "ssl/certs")
_FSIZE_BLOCKS = 131072  # ulimit -f counts 512- or 1024-byte blocks depending on the shell: 64-128 MiB
_CONTROL_TIMEOUT_S = 30.0
"""Deadline of the short control execs (wipe, kill). Every exec goes through `_Container.run`, whose
reads have a deadline: docker-py's own `exec_start` (not a socket) waits for the answer in `poll()`
with no timeout, so an exec the daemon never finishes (its container gone under it) would hang a
thread, and with it the event loop's shutdown, for ever."""
_INLINE_CODE = 100_000  # longer programs go through a file: one argv string is capped at 128 KiB
_reaped = False

# Runs a job: $1 kind (shell | python | pyfile), $2 CPU seconds, $3 file-size blocks, $4 program,
# $5 interpreter (empty: the image's python3 or python). Only POSIX sh features.
_RUN = r"""
ulimit -c 0 2>/dev/null; ulimit -t "$2" 2>/dev/null; ulimit -f "$3" 2>/dev/null
case "$1" in
shell)
  if command -v bash >/dev/null 2>&1; then exec bash -c "$4"; fi
  exec sh -c "$4" ;;
*)
  py="$5"
  if [ -z "$py" ]; then
    py=$(command -v python3 2>/dev/null || command -v python 2>/dev/null) || {
      echo "agentrl: this image has no python3 or python on PATH" >&2; exit 127; }
  fi
  if [ "$1" = pyfile ]; then exec "$py" "$4"; fi
  exec "$py" -c "$4" ;;
esac
"""
# $1 the work dir, $2 a relative path. Exit 2: missing or not a file; 13: outside the work dir.
_READ = r"""
root=$(readlink -f -- "$1") || exit 70
p="$root/$2"
[ -e "$p" ] || { echo "No such file: $2" >&2; exit 2; }
f=$(readlink -f -- "$p") || exit 2
case "$f" in "$root"/*) ;; *) echo "$2 resolves outside the work dir" >&2; exit 13 ;; esac
[ -f "$f" ] || { echo "$2 is not a regular file" >&2; exit 2; }
exec cat -- "$f"
"""
# $1 the work dir, $2 a relative path; the content is stdin. Exit 13: outside; 21: a directory.
_WRITE = r"""
root=$(readlink -f -- "$1") || exit 70
p="$root/$2"
d=$(dirname -- "$p")
e="$d"
while [ ! -e "$e" ] && [ ! -L "$e" ]; do e=$(dirname -- "$e"); done
r=$(readlink -f -- "$e") || { echo "$2 resolves outside the work dir" >&2; exit 13; }
case "$r/" in "$root"/*) ;; *) echo "$2 resolves outside the work dir" >&2; exit 13 ;; esac
mkdir -p -- "$d" || exit 1
if [ -e "$p" ] || [ -L "$p" ]; then
  f=$(readlink -f -- "$p") || { echo "$2 resolves outside the work dir" >&2; exit 13; }
  case "$f" in "$root"/*) ;; *) echo "$2 resolves outside the work dir" >&2; exit 13 ;; esac
  [ -d "$f" ] && { echo "$2 is a directory" >&2; exit 21; }
  p="$f"
fi
exec cat > "$p"
"""
# Empties the given directories (a pooled one-shot container between jobs).
_WIPE = r"""
for d in "$@"; do rm -rf -- "$d"/* "$d"/.[!.]* "$d"/..?* 2>/dev/null; done
for d in "$@"; do [ -z "$(ls -A -- "$d" 2>/dev/null)" ] || exit 1; done
"""


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


@dataclass(frozen=True)
class _Spec:
    """How a container is made; containers of one spec are interchangeable in a pool."""

    image: str
    workdir: str
    tmpfs_workdir: bool  # a fresh tmpfs at the work dir (else the image's own directory)
    read_only: bool  # one-shot containers: read-only root, wiped and reused
    user: str


@dataclass
class _Job:
    argv: list[str]
    stdin: bytes
    files: dict[str, bytes]


def _closed_result(start: float) -> ExecResult:
    """What a job cut short by the closing of its session or sandbox returns (as `local` does)."""
    return ExecResult("", "[sandbox session closed]", None, False, "closed", time.monotonic() - start)


class _Container:
    """One container and the blocking calls on it (run in threads)."""

    def __init__(self, api: Any, cid: str, spec: _Spec, init_pid: int) -> None:
        self.api = api
        self.id = cid
        self.spec = spec
        self.healthy = True
        self.closed = False  # set when it is removed on purpose (its session or the sandbox closed)
        self.keeper_uid = _uid_of(init_pid) if init_pid else None

    # ── cgroup files (present when the daemon runs on this machine) ──────────────────────────
    def _cgroup_file(self, *candidates: str) -> str | None:
        for rel in candidates:
            for path in (f"/sys/fs/cgroup/{rel.format(c='docker/' + self.id)}",
                         f"/sys/fs/cgroup/{rel.format(c='system.slice/docker-' + self.id + '.scope')}"):
                if os.path.exists(path):
                    return path
        return None

    def oom_kills(self) -> int:
        path = self._cgroup_file("memory/{c}/memory.oom_control", "{c}/memory.events")
        with contextlib.suppress(OSError, ValueError), open(path or "/nonexistent") as f:
            for line in f:
                if line.startswith("oom_kill "):
                    return int(line.split()[1])
        return 0

    def peak_memory_bytes(self) -> int | None:
        """The container's peak memory use so far (cgroup v1 max_usage, v2 memory.peak)."""
        path = self._cgroup_file("memory/{c}/memory.max_usage_in_bytes", "{c}/memory.peak")
        with contextlib.suppress(OSError, ValueError), open(path or "/nonexistent") as f:
            return int(f.read().strip())
        return None

    # ── exec ────────────────────────────────────────────────────────────────────────────────
    def run(self, argv: list[str], stdin: bytes, timeout_s: float, max_output: int, *,
            env: dict[str, str] | None, kill_after: bool = True,
            control: bool = False) -> tuple[bytes, bytes, int | None, str | None]:
        """One `docker exec`; returns stdout, stderr, exit code and why it was killed (or None).

        The container's jobs are killed afterwards (`kill_jobs`) when `kill_after`, or when the exec
        hit its deadline or output cap; never after a `control` exec (the wipe, or the kill itself)."""
        eid = self.api.exec_create(self.id, argv, stdin=True, user=self.spec.user, workdir=self.spec.workdir,
                                   environment=env)["Id"]
        sock = self.api.exec_start(eid, socket=True)
        raw = getattr(sock, "_sock", sock)

        def feed() -> None:
            with contextlib.suppress(OSError):
                raw.sendall(stdin)
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
                while len(pending) >= 8:  # Docker's stream framing: kind, 3 pad bytes, big-endian size
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
        if not control and (kill_after or killed):
            self.kill_jobs()
        exit_code = None
        for _ in range(200):
            info = self.api.exec_inspect(eid)
            if not info["Running"]:
                exit_code = info["ExitCode"]
                break
            time.sleep(0.01)
        return bytes(streams[1]), bytes(streams[2]), exit_code, killed

    def kill_jobs(self) -> None:
        """Kill every process of the container but its init and `sleep` (uid 65534).

        Done from the host through the container's cgroup: a `docker exec` cannot be relied on
        while an earlier exec still floods its output. Without access to the cgroup (a remote
        daemon, or not root here) an exec of `kill -9 -1` as the job's user does it.
        """
        procs = self._cgroup_file("pids/{c}/cgroup.procs", "{c}/cgroup.procs")
        if procs is not None and self.keeper_uid is not None:
            try:
                for _ in range(500):
                    with open(procs) as f:
                        victims = [int(p) for p in f.read().split() if _uid_of(int(p)) not in (None, self.keeper_uid)]
                    if not victims:
                        return
                    for pid in victims:
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(pid, 9)
                    time.sleep(0.002)
                return
            except PermissionError:
                pass
        self.run(["/bin/sh", "-c", "kill -9 -1 2>/dev/null; exit 0"], b"", _CONTROL_TIMEOUT_S, 4096, env=None,
                 control=True)

    def wipe(self) -> bool:
        """Empty the work dir, /tmp and /dev/shm of a one-shot container; False if that failed."""
        _, _, code, killed = self.run(["/bin/sh", "-c", _WIPE, "wipe", self.spec.workdir, "/tmp", "/dev/shm"], b"",
                                      _CONTROL_TIMEOUT_S, 65536, env=None, control=True)
        return killed is None and code == 0

    def remove(self) -> None:
        self.healthy = False
        with contextlib.suppress(Exception):
            self.api.remove_container(self.id, force=True, v=True)


def _uid_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as st:
            return int(next(line for line in st if line.startswith("Uid:")).split()[1])
    except (OSError, StopIteration, ValueError, IndexError):
        return None


class DockerSandbox:
    """Docker-isolated code execution with warm pools of containers (see the module docstring).

    Args:
        image: The containers' image, run as it is; default the host userland (`agentrl-sandbox:base`).
            `session(image=...)` overrides it per session (one sandbox serves many instance images).
        workdir: The work dir of sessions: a directory of the image (e.g. "/testbed") or, default,
            the image's WORKDIR if it has one, else a fresh tmpfs `/workspace`.
        user: The user jobs run as; default the image's USER (root if unset), uid 1000 on the host userland.
        memory_mb: Memory (and memory+swap) limit of one container; also the size of its tmpfs mounts.
        cpus: CPU share of one container (fractional CPUs).
        max_processes: The container's pids limit.
        max_output_bytes: Stdout plus stderr kept per job; more kills the job ("output").
        pool_size: Started containers kept ready per image and work dir (for an image other than
            `image`, at most the sessions announced with `expect` and not yet taken).
        max_idle: Idle started containers across all images; default `2 * pool_size`.
        max_concurrency: One-shot `exec` jobs running at once; default one per CPU core. Others wait.
        max_starting: Containers being started at once (the daemon slows down past a few).
        python: Interpreter for `exec(code=...)`; default the image's python3/python (the host's
            base interpreter on the host userland).
        base_url: Docker daemon address; default from the environment (DOCKER_HOST or the socket).
    """

    def __init__(self, *, image: str | None = None, workdir: str | None = None, user: str | None = None,
                 memory_mb: int = 512, cpus: float = 1.0, max_processes: int = 128, max_output_bytes: int = 1_000_000,
                 pool_size: int = 2, max_idle: int | None = None, max_concurrency: int | None = None,
                 max_starting: int = 4, python: str | None = None, base_url: str | None = None) -> None:
        docker = import_docker_sdk()
        try:
            self._client = docker.DockerClient(base_url=base_url) if base_url else docker.from_env()
            self._client.ping()
        except Exception as exc:
            raise SandboxUnavailableError(
                f"No Docker daemon answered ({type(exc).__name__}: {exc}); install and start one "
                "('apt-get install docker.io', then 'dockerd'), or use the 'local' backend."
            ) from exc
        global _reaped
        if not _reaped:
            _reaped = True
            with contextlib.suppress(Exception):
                n = reap_orphans(self._client)
                if n:
                    _log.info("removed %d sandbox container(s) left behind by dead processes", n)
        self._api = self._client.api
        self._base_url = base_url
        self.image = image or IMAGE
        self.workdir = workdir
        self.user = user
        exe, prefix = sandbox_python()
        self.python = python
        self._host_python = python or exe
        self._binds = {"/usr": {"bind": "/usr", "mode": "ro"}}
        if not python and not prefix.startswith("/usr/"):
            self._binds[prefix] = {"bind": prefix, "mode": "ro"}
        for name in _ETC:
            if os.path.exists(f"/etc/{name}"):
                self._binds[f"/etc/{name}"] = {"bind": f"/etc/{name}", "mode": "ro"}
        self._host_env = {"PATH": f"{os.path.dirname(self._host_python)}:/usr/local/bin:/usr/bin:/bin",
                          "HOME": WORKDIR, "LANG": "C.UTF-8", "TMPDIR": "/tmp", "USER": "sandbox",
                          "PYTHONDONTWRITEBYTECODE": "1"}
        self.memory_mb = memory_mb
        self.cpus = cpus
        self.max_processes = max_processes
        self.max_output_bytes = max_output_bytes
        self.pool_size = max(0, pool_size)
        self.max_idle = max(0, 2 * self.pool_size if max_idle is None else max_idle)
        self._expected: dict[str, int] = {}  # image -> sessions announced by `expect` and not yet taken
        self.max_concurrency = max(1, max_concurrency or os.cpu_count() or 1)
        self.max_starting = max(1, max_starting)
        self.container_starts: list[float] = []
        """Seconds each container start took (creation to running), for benchmarks."""
        self.peak_memory: list[int] = []
        """Peak memory in bytes of each removed container (when the cgroup is readable here)."""
        self._token = uuid.uuid4().hex
        self._labels = owner_labels(self._token)
        self._watchdog: Any = None
        self._images: dict[str, dict[str, Any]] = {}
        self._idle: dict[_Spec, list[_Container]] = {}
        self._refills: set[asyncio.Task[None]] = set()
        self._refilling: set[_Spec] = set()
        self._all: set[_Container] = set()
        self._sem: asyncio.Semaphore | None = None
        self._start_sem: asyncio.Semaphore | None = None
        self._closed = False
        atexit.register(self._remove_all_now)  # belt and braces: the watchdog does this too

    # ── images ──────────────────────────────────────────────────────────────────────────────
    def ensure_base_image(self) -> None:
        """Import `agentrl-sandbox:base` into the daemon if it is not there (nothing is pulled)."""
        try:
            self._client.images.get(IMAGE)
        except Exception:
            repo, tag = IMAGE.split(":")
            self._api.import_image_from_data(_base_image_tar(), repository=repo, tag=tag)

    def has_image(self, image: str) -> bool:
        """Whether the daemon has `image` (nothing is pulled)."""
        try:
            self._image_config(image)
            return True
        except SandboxUnavailableError:
            return False

    def _image_config(self, image: str) -> dict[str, Any]:
        if image not in self._images:
            if image == IMAGE:
                self.ensure_base_image()
            try:
                attrs = self._api.inspect_image(image)
            except Exception as exc:
                raise SandboxUnavailableError(
                    f"The Docker image {image!r} is not on this daemon ({type(exc).__name__}). agentrl pulls "
                    f"nothing: run 'docker pull {image}' (or build it) on the machine of the daemon first."
                ) from exc
            self._images[image] = attrs.get("Config") or {}
        return self._images[image]

    def _spec(self, image: str | None, workdir: str | None, one_shot: bool) -> _Spec:
        image = image or self.image
        if image == IMAGE:
            self._image_config(IMAGE)  # imported on first use: a fresh daemon does not have it
            return _Spec(IMAGE, WORKDIR, True, True, self.user or f"{JOB_UID}:{JOB_UID}")
        config = self._image_config(image)
        user = self.user or config.get("User") or "0"
        if one_shot:
            return _Spec(image, WORKDIR, True, True, user)
        wd = workdir or self.workdir or config.get("WorkingDir") or ""
        if not wd or wd == "/":
            return _Spec(image, WORKDIR, True, False, user)
        return _Spec(image, posixpath.normpath(wd), wd == WORKDIR, False, user)

    # ── containers ──────────────────────────────────────────────────────────────────────────
    def _start_container(self, spec: _Spec) -> _Container:
        if self._watchdog is None:
            self._watchdog = start_watchdog(self._token, self._base_url)
        mb = self.memory_mb
        tmpfs = {"/tmp": f"size={mb}m,mode=1777", "/dev/shm": f"size={mb}m,mode=1777"}
        owner = spec.user.split(":")[0]
        if spec.tmpfs_workdir:
            uid = owner if owner.isdigit() else "0"
            tmpfs[spec.workdir] = f"size={mb}m,uid={uid},mode=755"
        host = spec.image == IMAGE
        started = time.monotonic()
        container = self._client.containers.create(
            spec.image, ["/usr/bin/sleep" if host else "sleep", "infinity"], init=True,
            user=f"{KEEPER_UID}:{KEEPER_UID}", network_mode="none", cap_drop=["ALL"],
            security_opt=["no-new-privileges"], read_only=spec.read_only, tmpfs=tmpfs,
            volumes=self._binds if host else None, environment=self._host_env if host else None,
            working_dir=spec.workdir, mem_limit=f"{mb}m", memswap_limit=f"{mb}m", nano_cpus=int(self.cpus * 1e9),
            pids_limit=self.max_processes, labels=self._labels,
        )
        try:
            container.start()
            pid = int(self._api.inspect_container(container.id)["State"].get("Pid") or 0)
        except Exception:
            with contextlib.suppress(Exception):
                container.remove(force=True)
            raise
        self.container_starts.append(time.monotonic() - started)
        c = _Container(self._api, container.id, spec, pid)
        self._all.add(c)
        return c

    async def _new_container(self, spec: _Spec) -> _Container:
        if self._start_sem is None:
            self._start_sem = asyncio.Semaphore(self.max_starting)
        async with self._start_sem:
            if self._closed:
                raise SandboxClosedError("This DockerSandbox is closed; create a new one.")
            try:
                return await asyncio.to_thread(self._start_container, spec)
            except Exception as exc:
                raise SandboxError(f"Docker could not start a container from {spec.image!r}: {exc}") from exc

    def expect(self, image: str, sessions: int) -> None:
        """Announce `sessions` more sessions in `image`: its pool is kept warm for them (at most
        `pool_size` at a time, within `max_idle`) and no longer once they have been taken."""
        if sessions > 0:
            self._expected[image] = self._expected.get(image, 0) + sessions

    def _pool_target(self, spec: _Spec) -> int:
        """Containers of `spec` worth keeping started: the sandbox's own image always has a pool;
        another image only for the sessions announced for it and not yet taken."""
        if spec.read_only or spec.image == self.image:
            return self.pool_size
        return min(self.pool_size, self._expected.get(spec.image, 0))

    def idle_count(self) -> int:
        """Started containers waiting in the pools, all images together."""
        return sum(len(idle) for idle in self._idle.values())

    async def _take(self, spec: _Spec) -> _Container:
        if self._closed:
            raise SandboxClosedError("This DockerSandbox is closed; create a new one.")
        idle = self._idle.setdefault(spec, [])
        if not spec.read_only and spec.image in self._expected:
            self._expected[spec.image] -= 1
            if self._expected[spec.image] <= 0:
                del self._expected[spec.image]
        c = idle.pop() if idle else await self._new_container(spec)
        if len(idle) < self._pool_target(spec) and spec not in self._refilling:
            task = asyncio.ensure_future(self._refill(spec))
            self._refills.add(task)
            task.add_done_callback(self._refills.discard)
        return c

    async def _refill(self, spec: _Spec) -> None:
        if spec in self._refilling:
            return
        self._refilling.add(spec)
        idle = self._idle.setdefault(spec, [])
        try:
            while not self._closed and len(idle) < self._pool_target(spec) and self.idle_count() < self.max_idle:
                c = await self._new_container(spec)
                if self._closed:
                    await self._drop(c)
                    return
                idle.append(c)
        except SandboxError as exc:
            _log.warning("could not warm a container: %s", exc)
        finally:
            self._refilling.discard(spec)

    async def _drop(self, c: _Container) -> None:
        c.closed = True  # a job still running in it was cut short by its caller, not by a fault
        self._all.discard(c)
        peak = await asyncio.to_thread(c.peak_memory_bytes)
        if peak:
            self.peak_memory.append(peak)
        await asyncio.to_thread(c.remove)

    async def _release(self, c: _Container, keep: bool) -> None:
        idle = self._idle.setdefault(c.spec, [])
        if (keep and c.healthy and c.spec.read_only and not self._closed and len(idle) < self.pool_size
                and self.idle_count() < self.max_idle):
            idle.append(c)
        else:
            await self._drop(c)

    async def start(self, image: str | None = None, workdir: str | None = None) -> None:
        """Warm the pool now: `pool_size` one-shot containers, or session containers of `image`
        (announced as `pool_size` expected sessions when it is not the sandbox's own image)."""
        spec = self._spec(image, workdir, one_shot=image is None and workdir is None)
        if not spec.read_only and spec.image != self.image:
            self.expect(spec.image, self.pool_size - self._pool_target(spec))
        await self._refill(spec)

    # ── jobs ────────────────────────────────────────────────────────────────────────────────
    def _job(self, spec: _Spec, command: str | None, code: str | None, timeout_s: float,
             stdin: str | bytes | None, files: Mapping[str, str | bytes] | None) -> _Job:
        if (command is None) == (code is None):
            raise ValueError("Pass exactly one of `command` (a shell command) or `code` (Python source).")
        if not (isinstance(timeout_s, (int, float)) and timeout_s > 0):
            raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}.")
        written = {_relative(path, spec.workdir): data.encode() if isinstance(data, str) else bytes(data)
                   for path, data in (files or {}).items()}
        cpu = str(int(timeout_s) + 2)
        python = self._host_python if spec.image == IMAGE else (self.python or "")
        if command is not None:
            kind, program = "shell", command
        elif len(code or "") > _INLINE_CODE:
            kind, program = "pyfile", f"/tmp/.agentrl_job_{uuid.uuid4().hex[:8]}.py"
            written[program] = (code or "").encode()
        else:
            kind, program = "python", code or ""
        argv = ["/bin/sh", "-c", _RUN, "agentrl", kind, cpu, str(_FSIZE_BLOCKS), program, python]
        return _Job(argv, stdin.encode() if isinstance(stdin, str) else bytes(stdin or b""), written)

    def _env(self, c: _Container) -> dict[str, str] | None:
        return self._host_env if c.spec.image == IMAGE else None

    async def _put(self, c: _Container, path: str, data: bytes) -> None:
        """Write `data` at `path` (relative to the work dir, or absolute under /tmp)."""
        root = "/tmp" if path.startswith("/tmp/") else c.spec.workdir
        rel = path[len("/tmp/"):] if root == "/tmp" else path
        _, err, code, _ = await asyncio.to_thread(
            c.run, ["/bin/sh", "-c", _WRITE, "write", root, rel], data, 60, 65536, env=self._env(c), kill_after=False)
        _raise_for_file(path, code, err)

    async def _run(self, c: _Container, job: _Job, timeout_s: float) -> ExecResult:
        oom_before = c.oom_kills()
        start = time.monotonic()
        try:
            for path, data in job.files.items():
                try:
                    await self._put(c, path, data)
                except PermissionError as exc:
                    raise ValueError(f"Cannot write {path}: {exc}") from None
                except OSError as exc:
                    raise SandboxError(f"Docker could not write {path} into the container: {exc}") from exc
            out, err, code, killed = await asyncio.to_thread(
                c.run, job.argv, job.stdin, timeout_s, self.max_output_bytes, env=self._env(c))
        except (ValueError, SandboxError):
            if c.closed:
                return _closed_result(start)
            raise
        except Exception as exc:
            if c.closed:
                return _closed_result(start)
            c.healthy = False
            raise SandboxError(f"Docker failed to run the job: {type(exc).__name__}: {exc}") from exc
        duration = time.monotonic() - start
        if c.closed:  # the container was removed under the job (its session closed): the caller's doing
            return _closed_result(start)
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
        """Run one job in a clean container (read-only root, tmpfs work dir); see `Sandbox.exec`."""
        spec = self._spec(None, None, one_shot=True)
        job = self._job(spec, command, code, timeout_s, stdin, files)
        if self._sem is None:
            self._sem = asyncio.Semaphore(self.max_concurrency)
        async with self._sem:
            c = await self._take(spec)
            keep = False
            try:
                result = await self._run(c, job, timeout_s)
                keep = await asyncio.to_thread(c.wipe)
            finally:
                await self._release(c, keep)
        return result

    async def session(self, *, image: str | None = None, workdir: str | None = None) -> DockerSession:
        """A container of your own whose files persist across `exec` calls until `close()`.

        `image` runs that image as it is (default the sandbox's); `workdir` is the session's work
        dir inside it, e.g. "/testbed" for SWE-bench images (see the class docstring).
        """
        spec = self._spec(image, workdir, one_shot=False)
        return DockerSession(self, await self._take(spec))

    async def close(self) -> None:
        """Remove every container this sandbox started. Closing twice is a no-op."""
        if self._closed:
            return
        self._closed = True
        for task in list(self._refills):
            task.cancel()
        await asyncio.gather(*self._refills, return_exceptions=True)
        self._idle.clear()
        await asyncio.gather(*(self._drop(c) for c in list(self._all)))
        self._all.clear()
        await asyncio.to_thread(self._stop_watchdog)

    async def is_alive(self) -> bool:
        return not self._closed

    def _stop_watchdog(self) -> None:
        dog, self._watchdog = self._watchdog, None
        if dog is not None:
            with contextlib.suppress(OSError):
                dog.stdin.close()
            with contextlib.suppress(Exception):
                dog.wait(timeout=30)
            dog.close_log()

    def _remove_all_now(self) -> None:
        for c in list(self._all):
            c.remove()
        self._all.clear()
        self._stop_watchdog()


def _relative(path: str, workdir: str) -> str:
    norm = posixpath.normpath(path)
    if norm.startswith(workdir.rstrip("/") + "/"):
        norm = norm[len(workdir.rstrip("/")) + 1:]
    if not path or norm.startswith(("/", "../")) or norm in ("..", "."):
        raise ValueError(f"Path {path!r} is outside the sandbox work dir {workdir}; use a relative path.")
    return norm


def _raise_for_file(path: str, code: int | None, err: bytes) -> None:
    text = err.decode(errors="replace").strip()
    if code == 0:
        return
    if code == 2:
        raise FileNotFoundError(f"{path}: {text}")
    if code == 13:
        raise PermissionError(f"{path}: {text}")
    if code == 21:
        raise IsADirectoryError(f"{path}: {text}")
    raise OSError(f"{path}: {text or f'exit code {code}'}")


class DockerSession:
    """One container kept for a multi-step task; see `SandboxSession`."""

    def __init__(self, owner: DockerSandbox, container: _Container) -> None:
        self._owner = owner
        self._c: _Container | None = container
        self._lock = asyncio.Lock()
        self.image = container.spec.image
        self.workdir = container.spec.workdir

    @property
    def container_id(self) -> str | None:
        return self._c.id if self._c else None

    def _live(self) -> _Container:
        if self._c is None:
            raise SandboxClosedError("This docker session is closed; open a new one.")
        return self._c

    async def exec(self, command: str | None = None, *, code: str | None = None, timeout_s: float,
                   stdin: str | bytes | None = None, files: Mapping[str, str | bytes] | None = None) -> ExecResult:
        c = self._live()
        job = self._owner._job(c.spec, command, code, timeout_s, stdin, files)
        async with self._lock:
            return await self._owner._run(self._live(), job, timeout_s)

    async def read_file(self, path: str) -> bytes:
        c = self._live()
        rel = _relative(path, c.spec.workdir)
        async with self._lock:
            try:
                out, err, code, _ = await asyncio.to_thread(
                    self._live().run, ["/bin/sh", "-c", _READ, "read", c.spec.workdir, rel], b"", 60, 1 << 30,
                    env=self._owner._env(c), kill_after=False)
            except Exception as exc:
                raise SandboxError(f"Docker failed to read {path}: {type(exc).__name__}: {exc}") from exc
        _raise_for_file(path, code, err)
        return out

    async def write_file(self, path: str, data: str | bytes) -> None:
        c = self._live()
        rel = _relative(path, c.spec.workdir)
        async with self._lock:
            try:
                await self._owner._put(self._live(), rel, data.encode() if isinstance(data, str) else bytes(data))
            except OSError:
                raise
            except Exception as exc:
                raise SandboxError(f"Docker failed to write {path}: {type(exc).__name__}: {exc}") from exc

    async def close(self) -> None:
        c, self._c = self._c, None
        if c is not None:
            await self._owner._drop(c)

    async def is_alive(self) -> bool:
        if self._c is None or not self._c.healthy:
            return False
        try:
            state = await asyncio.to_thread(self._owner._api.inspect_container, self._c.id)
        except Exception:
            return False
        return bool(state.get("State", {}).get("Running"))
