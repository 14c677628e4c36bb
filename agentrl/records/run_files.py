"""The one write path of a run's records, and what a failed write means.

Every file the driver writes under the run directory (the prompt ledger, `metrics.jsonl`, the
rollout log, `eval.jsonl`, the run's identity and resume history, `result.json`) is written
through `append_text` or `replace_text`, or inside `writing(path)`. A write that fails because of
where it writes, not because of what it writes, becomes one `RunWriteError` naming the file, the
cause, the mount and device it lives on, and the fix:

    ENOSPC          the disk is full            free space on <mount> or move run.output_dir
    EDQUOT          the disk quota is exceeded  free space (or raise the quota) on <mount> or move ...
    EROFS           the filesystem is read-only remount <mount> read-write or move run.output_dir
    EACCES, EPERM   permission was denied       give this user write access to ... or move ...
    ENOENT, gone    the run directory is gone   restore or remount the run directory

The driver adds the command that continues the run (`RunWriteError.continue_with`) and stops the
run cleanly with it. Any other `OSError` (a bug: a path that was never created) passes unchanged.
`classify_write_error` is the classification alone, which the driver also applies to errors that
come back from other processes as text (a trainer's export on a full disk).

A failed `replace_text` removes its temporary file, so a full disk is not made fuller. This module
writes only what it is given; it does not know what the records mean.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
from collections.abc import Iterator
from pathlib import Path

from agentrl.errors import RunWriteError

__all__ = ["append_text", "classify_write_error", "mount_of", "replace_text", "writing"]

_FIX_SPACE = "Free space on {where} or move run.output_dir"
_CAUSES: dict[int, tuple[str, str]] = {
    errno.ENOSPC: ("the disk is full", _FIX_SPACE),
    errno.EDQUOT: ("the disk quota is exceeded", "Free space (or raise the quota) on {where} or move run.output_dir"),
    errno.EROFS: ("the filesystem is read-only", "Remount {where} read-write or move run.output_dir"),
    errno.EACCES: ("permission was denied", "Give this user write access to {folder} or move run.output_dir"),
    errno.EPERM: ("permission was denied", "Give this user write access to {folder} or move run.output_dir"),
}
_GONE = ("the run directory is gone (deleted or unmounted while the run wrote to it)",
         "Restore or remount {run_dir} (it holds the run's checkpoints)")
# How these errors read once they have crossed a process boundary as text (a Ray actor's exception).
_TEXT = [(re.compile(r"\[Errno 28\]|No space left on device"), errno.ENOSPC),
         (re.compile(r"\[Errno 122\]|Disk quota exceeded"), errno.EDQUOT),
         (re.compile(r"\[Errno 30\]|Read-only file system"), errno.EROFS)]


def mount_of(path: str | Path) -> str:
    """`<mount point> (<device>, <filesystem>)` of the filesystem `path` is (or would be) on."""
    probe = Path(os.path.abspath(path))
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    while not os.path.ismount(probe) and probe != probe.parent:
        probe = probe.parent
    device = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/mounts").read_text().splitlines():
            fields = line.split()
            if len(fields) >= 3 and fields[1].replace("\\040", " ") == str(probe):
                device = f"{fields[0]}, {fields[2]}"  # the last line for a mount point is the visible one
    return f"{probe} ({device})" if device else str(probe)


def _errno_of(exc: BaseException) -> int | None:
    if isinstance(exc, OSError) and exc.errno is not None:
        return exc.errno
    text = str(exc)
    return next((code for pattern, code in _TEXT if pattern.search(text)), None)


def classify_write_error(exc: BaseException, path: str | Path, run_dir: str | Path | None = None) -> RunWriteError | None:
    """The `RunWriteError` that a failed write of `path` means, or None when `exc` is not a failure
    of the place written to (see the module docstring). `run_dir`: the run's directory, so a
    `FileNotFoundError` is told apart (the directory vanished) from a bug (a folder never made)."""
    path = Path(path)
    code = _errno_of(exc)
    detail = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else code}"
    folder = path.parent
    if code == errno.ENOENT:
        root = Path(run_dir) if run_dir is not None else folder
        if root.is_dir():  # the run directory is there: a folder that was never made is a bug
            return None
        cause, fix = _GONE
        return RunWriteError(str(path), cause, detail, mount_of(root), fix.format(run_dir=root))
    if code not in _CAUSES:
        return None
    cause, fix = _CAUSES[code]
    where = mount_of(folder)
    return RunWriteError(str(path), cause, detail, where, fix.format(where=where.split(" (")[0], folder=folder))


@contextlib.contextmanager
def writing(path: str | Path, run_dir: str | Path | None = None) -> Iterator[None]:
    """Writes to `path` inside this block that fail where they write raise `RunWriteError`."""
    try:
        yield
    except OSError as exc:
        error = classify_write_error(exc, path, run_dir)
        if error is None:
            raise
        raise error from exc


def append_text(path: str | Path, text: str, run_dir: str | Path | None = None) -> None:
    """Append `text` to `path` (created when missing), flushed before it returns."""
    with writing(path, run_dir), Path(path).open("a") as f:
        f.write(text)
        f.flush()


def replace_text(path: str | Path, text: str, run_dir: str | Path | None = None) -> None:
    """Write `path` whole through a temporary file renamed over it: a reader sees the old file or
    the new one, never half of one; a failed write removes the temporary file."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    with writing(path, run_dir):
        try:
            tmp.write_text(text)
            tmp.replace(path)
        except BaseException:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise
