"""Start-up failures of what a run starts, in one shape: what failed, why, and what to do.

`starting(part, fix)` wraps the start of one part of a run: Ray, the cluster's reservation, the
sandbox hosts, the trainer, the inference engine (split servers, or the engine inside the trainer
when colocated). Whatever it raises becomes a `StartupError`:

    Could not start <part>: <why>. <fix>; then <how to continue the run>.

`why` is the error's own first line (for an agentrl error, its whole message: it already names the
file or log to read). Errors that say by themselves what to change in the config or the cluster
(`ConfigError`, `PreflightError`, `CheckpointError`, a `StartupError` from an inner part), Ctrl-C
and cancellation pass unchanged. The console shows the message only (the CLI prints agentrl's
errors without a traceback); `driver.log` keeps the traceback of the original error.

`init_ray(address)` starts or joins Ray through it. A local Ray that fails to come up is tried once
more after `ray.shutdown()` (which ends the processes the failed attempt started): Ray waits a
fixed 30 s for its raylet to register with the GCS and raises "The current node timed out during
startup" when a loaded machine is slower than that, which a second attempt usually survives. A
stale session directory is not deleted: other Ray instances on the machine may be using
`/tmp/ray`. A second failure names the temp folder, the space left on its disk, and the fixes
(`ray stop --force`, free space, `RAY_TMPDIR`).

This module starts nothing itself except Ray; it does not retry any other part.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from agentrl.errors import AgentRLError, CheckpointError, ConfigError, PreflightError, StartupError
from agentrl.records.library_logs import adopt_logger

__all__ = ["init_ray", "ray_temp_dir", "starting"]

log = logging.getLogger("agentrl.run")

_PASS = (StartupError, ConfigError, PreflightError, CheckpointError)


def _why(exc: BaseException) -> str:
    if isinstance(exc, AgentRLError):
        return str(exc).rstrip(". ")
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    # A Ray task error ends with the error that ended it; other errors say most in their first line.
    said = lines[-1] if lines and type(exc).__module__.startswith("ray") else (lines[0] if lines else "")
    return f"{type(exc).__name__}: {said[:500]}" if said else type(exc).__name__


@contextlib.contextmanager
def starting(part: str, fix: str, then: str = "") -> Iterator[None]:
    """Raise what fails inside as `StartupError` "Could not start `part`: why. `fix`; then `then`."
    (see the module docstring). `then`: how to continue the run once fixed (the driver's command)."""
    try:
        yield
    except _PASS:
        raise
    except Exception as exc:
        ending = f"; then {then}" if then else ""
        raise StartupError(f"Could not start {part}: {_why(exc)}. {fix}{ending}.", part=part) from exc


def ray_temp_dir() -> Path:
    """Where a local Ray keeps its sessions: `$RAY_TMPDIR/ray`, else `<system temp>/ray`."""
    return Path(os.environ.get("RAY_TMPDIR") or tempfile.gettempdir()) / "ray"


def _space_left(folder: Path) -> str:
    probe = folder
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        free = shutil.disk_usage(probe).free
    except OSError:
        return ""
    return f" (its disk has {free / 2**20:.0f} MiB free)"


def init_ray(cluster_address: str | None, then: str = "") -> None:
    """Start a local Ray, or join the one `RAY_ADDRESS` or `cluster.address` names (see the module
    docstring); `then` is how to continue the run, for the messages."""
    import ray

    if ray.is_initialized():
        return
    adopt_logger("ray")  # its notices (token authentication is on) go to the run's log, not the console
    address = cluster_address or os.environ.get("RAY_ADDRESS")

    def init() -> None:
        # no address given: "local", a Ray of this run's own. Left to Ray (None), it would join the
        # cluster `ray start` last left on this machine (/tmp/ray/ray_current_cluster), another job's.
        ray.init(address=address or "local", include_dashboard=False, log_to_driver=True, configure_logging=False,
                 ignore_reinit_error=True)

    if cluster_address:
        try:
            init()
        except (ConnectionError, RuntimeError) as exc:
            raise PreflightError(
                f"cluster.address={address}: cannot join the Ray cluster there ({type(exc).__name__}: "
                f"{str(exc).splitlines()[0] if str(exc) else ''}). Start its head with 'ray start --head', give "
                "the HOST:PORT it prints, and run from a node of the cluster (with its token, when Ray's token "
                "authentication is on).") from exc
        return
    if address:
        with starting(f"Ray (joining RAY_ADDRESS={address})",
                      "Check that a Ray instance runs there ('ray status'), or unset RAY_ADDRESS to let the run "
                      "start a local one", then):
            init()
        return
    temp = ray_temp_dir()
    with starting(f"Ray (a local instance, sessions under {temp}; tried twice)",
                  f"End stale Ray processes with 'ray stop --force', make room on the disk of {temp}"
                  f"{_space_left(temp)}, or set RAY_TMPDIR to a folder on a disk with room", then):
        try:
            init()
        except Exception as exc:
            log.warning("Ray did not start (%s: %s); ending what it started and trying once more", type(exc).__name__,
                        str(exc).splitlines()[0] if str(exc) else "")
            ray.shutdown()
            init()
