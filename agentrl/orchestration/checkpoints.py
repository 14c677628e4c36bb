"""A run's checkpoints on disk: written safely, checksummed, pruned, verified and found again.

`CheckpointStore(run_dir / "checkpoints", keep=run.keep_checkpoints)` owns the folder:

- `save(step, write_trainer, driver_state)` writes `step-N/` the safe way: everything goes into a
  temporary folder `.step-N.tmp/` (the trainer's files through `write_trainer`, then
  `driver_state.json`), every file is fsynced, `MANIFEST.json` records each file's size and SHA-256,
  and only then is the folder renamed into place and the `latest` pointer moved (both atomic, the
  folder fsynced after each). A crash at any moment leaves either the old checkpoint or the new one,
  never half of one. A failed write (a full disk) removes its own temporary folder and raises
  `CheckpointError` naming the cause and the intact checkpoint a resume would use. A step saved
  again (a resumed run re-saving the step it resumed at) moves the earlier folder aside as
  `step-N.replaced-<time>/`. Afterwards `prune` keeps at most `keep` checkpoint folders (0 keeps
  every one): the newest `step-N/` first, then the newest replaced copies in what is left; the
  checkpoint `latest` names is never deleted.
- `resumable()` finds the checkpoint to resume from: the newest whose files all match their
  manifest (same size, same checksum: a same-size corruption inside a shard is found) and whose
  driver state parses. Newer ones that fail are moved aside as `step-N.bad/` (kept for inspection,
  out of pruning's way; `Checkpoint.set_aside` says why, naming the file), and the next older
  intact one is used.
  If checkpoints exist and none is intact, `CheckpointError` lists each with its problem. This runs
  before any server or trainer starts.
- `move_aside_earlier_attempt(run_dir)`: a fresh start in a directory holding another attempt's
  records but no checkpoint moves them into `previous/<time>/` (the `checkpoints/` folder, which
  then holds no checkpoint, stays: it may be a mount point, and so does the live run's `run.lock`);
  nothing a run wrote is deleted.

The trainer backends' own file formats are not this module's business; it checksums whatever
files they write.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import re
import shutil
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agentrl.errors import CheckpointError
from agentrl.orchestration.run_lock import LOCK_FILE

__all__ = [
    "DRIVER_STATE",
    "MANIFEST",
    "Checkpoint",
    "CheckpointStore",
    "move_aside_earlier_attempt",
    "verify_checkpoint",
]

log = logging.getLogger("agentrl.run")

DRIVER_STATE = "driver_state.json"
MANIFEST = "MANIFEST.json"
LATEST = "latest"
_NAME = re.compile(r"^step-(\d+)$")
_REPLACED = re.compile(r"^step-(\d+)\.replaced-(.+)$")
_DRIVER_KEYS = ("steps_done", "trainer_version", "sampler", "ledger")
_CHUNK = 8 << 20


@dataclass
class Checkpoint:
    """A verified checkpoint: its folder, step and parsed driver state."""

    path: Path
    step: int
    state: dict[str, Any] = field(default_factory=dict)
    set_aside: list[str] = field(default_factory=list)
    """What was wrong with each newer checkpoint that was skipped and moved aside, for the log."""

    @property
    def name(self) -> str:
        return self.path.name


# ── files ───────────────────────────────────────────────────────────────────────────────────


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):  # some filesystems cannot fsync a directory; nothing to do then
        _fsync_file(path)


def _write_durably(path: Path, text: str) -> None:
    with path.open("w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file())


def _seal(folder: Path) -> None:
    """fsync every file under `folder` and write its MANIFEST.json (sizes and SHA-256)."""
    entries: dict[str, dict[str, Any]] = {}
    for path in _files(folder):
        if path.name == MANIFEST:
            continue
        _fsync_file(path)
        entries[path.relative_to(folder).as_posix()] = {"size": path.stat().st_size, "sha256": _sha256(path)}
    _write_durably(folder / MANIFEST, json.dumps({"format": 1, "algorithm": "sha256", "files": entries}, indent=1))
    for sub in sorted({p.parent for p in _files(folder)} | {folder}, key=lambda p: -len(p.parts)):
        _fsync_dir(sub)


def verify_checkpoint(path: Path) -> tuple[dict[str, Any] | None, str]:
    """(driver state, "") if checkpoint `path` is intact, else (None, what is wrong, naming the file)."""
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        if (path / DRIVER_STATE).is_file() and (path / "trainer").is_dir():
            state, problem = _driver_state(path)
            if state is not None:
                log.warning("checkpoint %s has no %s (written by an older agentrl): its files cannot be "
                            "verified", path, MANIFEST)
            return state, problem
        return None, f"{MANIFEST} is missing: the checkpoint was never completed"
    try:
        manifest = json.loads(manifest_path.read_text())
        files = dict(manifest["files"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return None, f"{manifest_path} cannot be read ({type(exc).__name__}: {exc})"
    for rel, want in files.items():
        file = path / rel
        if not file.is_file():
            return None, f"{file} is missing"
        size = file.stat().st_size
        if size != want["size"]:
            return None, f"{file} has {size} bytes, the manifest says {want['size']} (truncated or overwritten)"
        if _sha256(file) != want["sha256"]:
            return None, f"{file} does not match its SHA-256 checksum in {MANIFEST} (the file is corrupt)"
    return _driver_state(path)


def _driver_state(path: Path) -> tuple[dict[str, Any] | None, str]:
    file = path / DRIVER_STATE
    try:
        state = json.loads(file.read_text())
    except FileNotFoundError:
        return None, f"{file} is missing"
    except (OSError, ValueError) as exc:
        return None, f"{file} is not valid JSON (truncated or corrupt): {exc}"
    missing = [k for k in _DRIVER_KEYS if not isinstance(state, dict) or k not in state]
    if missing:
        return None, f"{file} lacks {', '.join(missing)}"
    return state, ""


def _disk_full(exc: BaseException, folder: Path) -> bool:
    if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
        return True
    text = str(exc)
    if "No space left on device" in text or "Errno 28" in text:
        return True
    with contextlib.suppress(OSError):
        usage = shutil.disk_usage(folder)
        return usage.free < max(1 << 20, usage.total // 100)
    return False


# ── the store ───────────────────────────────────────────────────────────────────────────────


class CheckpointStore:
    """The `checkpoints/` folder of one run (see the module docstring)."""

    def __init__(self, directory: str | Path, *, keep: int = 2, resume_command: str = "") -> None:
        """`resume_command`: the command that continues the run (`run_commands.resume_command`),
        named when a checkpoint cannot be written."""
        self.directory = Path(directory)
        self.keep = keep
        self.resume_command = resume_command

    def complete(self) -> list[tuple[int, Path]]:
        """(step, folder) of every checkpoint folder with a final name, oldest first (not verified)."""
        if not self.directory.is_dir():
            return []
        found = []
        for p in self.directory.iterdir():
            m = _NAME.match(p.name)
            if m and p.is_dir():
                found.append((int(m.group(1)), p))
        return sorted(found)

    def latest_name(self) -> str | None:
        with contextlib.suppress(OSError):
            return (self.directory / LATEST).read_text().strip() or None
        return None

    # ── writing ─────────────────────────────────────────────────────────────────────────────
    async def save(
        self, steps_done: int, write_trainer: Callable[[Path], Awaitable[Any]], driver_state: dict[str, Any]
    ) -> Path:
        """Write checkpoint `step-<steps_done>` (see the module docstring); return its folder."""
        import asyncio

        name = f"step-{steps_done:06d}"
        final = self.directory / name
        tmp = self.directory / f".{name}.tmp"
        self.directory.mkdir(parents=True, exist_ok=True)
        if tmp.exists():  # our own unfinished write from a crash: never a checkpoint
            shutil.rmtree(tmp)
        try:
            tmp.mkdir()
            await write_trainer(tmp / "trainer")
            _write_durably(tmp / DRIVER_STATE, json.dumps(driver_state))
            await asyncio.to_thread(_seal, tmp)
            if final.exists():  # a step saved again after a resume: keep the earlier one aside (pruned)
                final.rename(self._replaced_name(name))
            tmp.rename(final)
            _fsync_dir(self.directory)
            pointer = self.directory / f".{LATEST}.tmp"
            _write_durably(pointer, name)
            pointer.replace(self.directory / LATEST)
            _fsync_dir(self.directory)
        except BaseException as exc:
            full = isinstance(exc, Exception) and _disk_full(exc, self.directory)  # before freeing the space
            shutil.rmtree(tmp, ignore_errors=True)
            if full:
                previous = self.latest_name()
                raise CheckpointError(
                    f"Could not write checkpoint {name}: the disk under {self.directory} is full "
                    f"({type(exc).__name__}: {str(exc).splitlines()[0][:300]}). The partial write was removed; "
                    + (f"the previous checkpoint {previous} is intact. " if previous else "no earlier checkpoint exists. ")
                    + "Free some space (or keep fewer checkpoints: run.keep_checkpoints) and continue "
                    + (f"with: {self.resume_command}" if self.resume_command
                       else f"the run with resume=true run.name={self.directory.parent.name}")
                ) from exc
            raise
        self.prune()
        return final

    def _replaced_name(self, name: str) -> Path:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        aside, n = self.directory / f"{name}.replaced-{stamp}", 1
        while aside.exists():  # saved twice within a second: never rename onto an earlier copy
            n += 1
            aside = self.directory / f"{name}.replaced-{stamp}-{n}"
        return aside

    def replaced(self) -> list[Path]:
        """The `step-N.replaced-<time>` copies of re-saved steps, oldest first (by step, then time)."""
        if not self.directory.is_dir():
            return []
        found = []
        for p in self.directory.iterdir():
            m = _REPLACED.match(p.name)
            if m and p.is_dir():
                found.append((int(m.group(1)), m.group(2), p))
        return [p for *_, p in sorted(found)]

    def prune(self) -> list[Path]:
        """Keep at most `keep` checkpoint folders (0: keep every one); delete the rest, return them.

        The `step-N/` folders, which a resume uses, come first, newest first; the `step-N.replaced-*`
        copies (earlier saves of a re-saved step, which no resume uses) fill what is left of `keep`,
        newest first. The checkpoint `latest` names is never deleted.
        """
        if self.keep <= 0:
            return []
        finals = [p for _, p in reversed(self.complete())]
        ranked = finals + list(reversed(self.replaced()))
        latest = self.latest_name()
        doomed = [p for p in ranked[self.keep:] if p.name != latest]
        for p in doomed:
            shutil.rmtree(p, ignore_errors=True)
            log.info("checkpoint %s deleted (run.keep_checkpoints=%d)", p, self.keep)
        return doomed

    # ── reading ─────────────────────────────────────────────────────────────────────────────
    def resumable(self) -> Checkpoint | None:
        """The newest intact checkpoint (see the module docstring); None when there is none at all."""
        done = self.complete()
        if not done:
            return None
        rejected: list[tuple[Path, str]] = []
        for step, path in reversed(done):
            state, problem = verify_checkpoint(path)
            if state is not None:
                notes = []
                for bad, why in rejected:
                    aside = bad.with_name(f"{bad.name}.bad")
                    bad.rename(aside)
                    notes.append(f"checkpoint {bad.name} is damaged ({why}); moved aside to {aside}, resuming "
                                 f"from {path.name} instead")
                return Checkpoint(path, step, state, notes)
            rejected.append((path, problem))
        raise CheckpointError(
            f"No intact checkpoint in {self.directory}; nothing was started:\n"
            + "\n".join(f"  {p.name}: {why}" for p, why in rejected)
            + "\nThe run's records are kept. Restore the damaged file from a copy if you have one, or start a new "
            "run under another run.name."
        )


# run.lock is the live run's own lock (`run_lock.py`): it stays where that run holds it.
_EARLIER_ATTEMPT_KEEP = {"previous", "checkpoints", LOCK_FILE}


def move_aside_earlier_attempt(run_dir: Path) -> Path | None:
    """Move everything in `run_dir` (another attempt's records, no checkpoint) into
    `run_dir/previous/<time>/`; return that folder, or None when there was nothing to move."""
    if not run_dir.is_dir():
        return None
    entries = [p for p in run_dir.iterdir() if p.name not in _EARLIER_ATTEMPT_KEEP]
    if not entries:
        return None
    aside = run_dir / "previous" / time.strftime("%Y%m%d-%H%M%S")
    n = 1
    while aside.exists():
        n += 1
        aside = aside.with_name(f"{time.strftime('%Y%m%d-%H%M%S')}-{n}")
    aside.mkdir(parents=True)
    for p in entries:
        p.rename(aside / p.name)
    return aside
