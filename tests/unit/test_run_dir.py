"""A run directory at start: one live owner (`run.lock`), and a resume that matches the run it
continues (`run_identity.json`), both checked before anything starts and before anything in the
directory is written. Real files in tmp_path; the checkpoint's trainer part is a few bytes."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from agentrl.config import load_config
from agentrl.errors import ConfigError
from agentrl.orchestration.checkpoints import CheckpointStore
from agentrl.orchestration.driver import _prepare_run_dir, _settle_run_dir, check_run_dir
from agentrl.orchestration.run_identity import IDENTITY_FILE, RESUME_HISTORY, run_identity, write_identity
from agentrl.orchestration.run_lock import LOCK_FILE, RunLock


def config(tmp_path: Path, *extra: str):
    return load_config(None, [f"run.output_dir={tmp_path / 'runs'}", "run.name=r", *extra])


def started_run(tmp_path: Path, *extra: str) -> Path:
    """A run directory as a first session leaves it: its config, identity and one checkpoint."""
    from agentrl.config import save_config

    cfg = config(tmp_path, *extra)
    run_dir = tmp_path / "runs" / "r"
    save_config(cfg, run_dir)
    write_identity(run_dir, run_identity(cfg))

    async def trainer(folder: Path) -> None:
        folder.mkdir(parents=True)
        (folder / "model.bin").write_bytes(b"weights" * 8)

    state = {"steps_done": 1, "trainer_version": 1, "sampler": {}, "ledger": {"entries": []}}
    asyncio.run(CheckpointStore(run_dir / "checkpoints").save(1, trainer, state))
    return run_dir


def prepare(cfg):
    """`_prepare_run_dir` inside an exit stack, as the Run does; (its result, the closed stack's effect)."""

    async def go():
        async with contextlib.AsyncExitStack() as stack:
            prepared = _prepare_run_dir(cfg, stack)
            return prepared, _settle_run_dir(cfg, prepared)

    return asyncio.run(go())


def data_file(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


# ── the run's identity ──────────────────────────────────────────────────────────────────────


def test_a_resume_with_another_seed_data_content_and_env_is_refused_naming_each_and_writes_nothing(
    tmp_path: Path,
) -> None:
    train = data_file(tmp_path / "train.jsonl", '{"a": 1}\n')
    run_dir = started_run(tmp_path, "env=retool", f"data.train_files=[{train}]")
    before = {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file()}
    old_digest = hashlib.sha256(b'{"a": 1}\n').hexdigest()
    data_file(tmp_path / "train.jsonl", '{"a": 2}\n')  # the same size, other content
    with pytest.raises(ConfigError) as caught:
        prepare(config(tmp_path, "env=arithmetic", f"data.train_files=[{train}]", "run.seed=7", "resume=true"))
    message = str(caught.value)
    assert "run.seed: 0 -> 7" in message
    assert 'env.name: "retool" -> "arithmetic"' in message  # the retool preset's other keys are named too
    new_digest = hashlib.sha256(b'{"a": 2}\n').hexdigest()
    assert f'data.train_files.sha256: ["{old_digest}"] -> ["{new_digest}"]' in message
    allow = message.split("run.resume_allow=[")[1].split("]")[0].split(",")
    assert {"data.train_files.sha256", "env.name", "run.seed"} <= set(allow)
    assert "data.train_files:" not in message, "the same path: only its content differs"
    assert "Nothing was started" in message
    after = {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file() and p.name != LOCK_FILE}
    assert after == before, "a refused resume changes nothing in the run directory (config.yaml included)"
    assert (run_dir / LOCK_FILE).read_text() == "", "the lock was released"
    assert not (run_dir / RESUME_HISTORY).exists()


def test_resume_allow_lets_a_listed_key_through_and_records_it(tmp_path: Path) -> None:
    run_dir = started_run(tmp_path)
    cfg = config(tmp_path, "run.seed=7", "algorithm.clip_high=0.3", "resume=true",
                 "run.resume_allow=[run.seed]")
    with pytest.raises(ConfigError, match=r"algorithm.clip_high: 0.28 -> 0.3") as caught:
        prepare(cfg)  # what is not listed is still refused
    assert "run.seed" not in str(caught.value)

    cfg = config(tmp_path, "run.seed=7", "algorithm.clip_high=0.3", "resume=true",
                 "run.resume_allow=[run.seed,algorithm]")  # a section allows every key in it
    prepared, notes = prepare(cfg)
    assert prepared.checkpoint is not None and prepared.checkpoint.step == 1
    assert "resume with a changed run.seed (allowed by run.resume_allow): 0 -> 7" in notes
    assert "resume with a changed algorithm.clip_high (allowed by run.resume_allow): 0.28 -> 0.3" in notes
    history = [json.loads(line) for line in (run_dir / RESUME_HISTORY).read_text().splitlines()]
    assert len(history) == 1 and history[0]["checkpoint"] == "step-000001"
    assert history[0]["allowed"] == {"algorithm.clip_high": {"old": 0.28, "new": 0.3},
                                     "run.seed": {"old": 0, "new": 7}}
    assert json.loads((run_dir / IDENTITY_FILE).read_text())["identity"]["run.seed"] == 7
    assert "seed: 7" in (run_dir / "config.yaml").read_text()
    # the next resume with the same config needs no allowance: it is compared with the changed identity
    prepared, notes = prepare(config(tmp_path, "run.seed=7", "algorithm.clip_high=0.3", "resume=true"))
    assert notes == [] and len((run_dir / RESUME_HISTORY).read_text().splitlines()) == 2


def test_resume_allow_names_only_compared_keys_and_only_with_resume(tmp_path: Path) -> None:
    started_run(tmp_path)
    with pytest.raises(ConfigError, match=r"'run.sead' \(did you mean 'run.seed'\?\)"):
        prepare(config(tmp_path, "resume=true", "run.resume_allow=[run.sead]"))
    with pytest.raises(ConfigError, match="run.resume is false"):
        check_run_dir(config(tmp_path, "run.name=other", "run.resume_allow=[run.seed]"))


def test_a_run_directory_without_an_identity_resumes_once_with_a_warning_and_records_it(tmp_path: Path) -> None:
    run_dir = started_run(tmp_path)
    (run_dir / IDENTITY_FILE).unlink()  # as an older agentrl left it
    _, notes = prepare(config(tmp_path, "resume=true", "run.seed=3"))
    assert len(notes) == 1 and f"no {IDENTITY_FILE}" in notes[0]
    assert json.loads((run_dir / IDENTITY_FILE).read_text())["identity"]["run.seed"] == 3
    with pytest.raises(ConfigError, match="run.seed: 3 -> 4"):
        prepare(config(tmp_path, "resume=true", "run.seed=4"))


def test_validate_checks_a_resume_as_the_run_does_and_writes_nothing(tmp_path: Path) -> None:
    run_dir = started_run(tmp_path)
    with pytest.raises(ConfigError, match="run.seed: 0 -> 9"):
        check_run_dir(config(tmp_path, "resume=true", "run.seed=9"))
    assert check_run_dir(config(tmp_path, "resume=true")) == [
        f"resume: {run_dir} matches this config in what shapes its data and model"]
    assert not (run_dir / LOCK_FILE).exists() and not (run_dir / RESUME_HISTORY).exists()


def test_a_fresh_start_records_its_identity(tmp_path: Path) -> None:
    train = data_file(tmp_path / "train.jsonl", '{"a": 1}\n')
    prepared, _ = prepare(config(tmp_path, f"data.train_files=[{train}]", "run.seed=5"))
    identity = json.loads((prepared.path / IDENTITY_FILE).read_text())["identity"]
    assert identity["run.seed"] == 5 and identity["data.train_files"] == [train]
    assert identity["data.train_files.sha256"] == [hashlib.sha256(b'{"a": 1}\n').hexdigest()]
    assert (prepared.path / "config.yaml").is_file()


# ── the lock ────────────────────────────────────────────────────────────────────────────────

HOLDER = textwrap.dedent("""
    import fcntl, json, os, sys
    fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.write(fd, json.dumps({"pid": os.getpid(), "host": "holder-host", "started_at": "2026-01-02T03:04:05Z",
                             "command": "agentrl run run.name=r"}).encode())
    print("held", flush=True)
    sys.stdin.read()
""")


def test_a_second_run_is_refused_while_another_process_holds_the_directory(tmp_path: Path) -> None:
    run_dir = tmp_path / "runs" / "r"
    run_dir.mkdir(parents=True)
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(run_dir / LOCK_FILE)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        with pytest.raises(ConfigError) as caught:
            prepare(config(tmp_path))
        message = str(caught.value)
        assert f"pid {holder.pid} on host holder-host, started 2026-01-02T03:04:05Z" in message
        assert "choose another run.name" in message and "Wait for that run to end" in message
        assert not (run_dir / "config.yaml").exists() and not (run_dir / IDENTITY_FILE).exists()
    finally:
        holder.communicate("", timeout=10)
    # the holder is gone: its flock went with it, and the next run takes the directory over
    lock = RunLock.acquire(run_dir, command="test")
    try:
        assert lock.took_over is not None and lock.took_over["pid"] == holder.pid
    finally:
        lock.release()


def test_the_lock_refuses_a_second_holder_in_the_same_process_and_is_released(tmp_path: Path) -> None:
    first = RunLock.acquire(tmp_path, command="first")
    owner = json.loads((tmp_path / LOCK_FILE).read_text())
    assert owner["pid"] == os.getpid() and owner["host"] == socket.gethostname() and owner["command"] == "first"
    with pytest.raises(ConfigError, match=f"pid {os.getpid()}"):
        RunLock.acquire(tmp_path, command="second")
    first.release()
    first.release()  # twice is harmless
    assert (tmp_path / LOCK_FILE).read_text() == ""
    second = RunLock.acquire(tmp_path, command="second")
    assert second.took_over is None, "a cleanly released lock is not a stale one"
    second.release()


def test_a_stale_lock_file_is_taken_over_with_a_log_line(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = {"pid": int(dead.stdout), "host": socket.gethostname(), "started_at": "2026-01-01T00:00:00Z",
             "command": "agentrl run run.name=r"}
    (tmp_path / LOCK_FILE).write_text(json.dumps(stale))
    with caplog.at_level(logging.WARNING, logger="agentrl.run"):
        lock = RunLock.acquire(tmp_path, command="new")
    try:
        assert lock.took_over == stale
        assert f"pid {stale['pid']} on host {stale['host']}, started 2026-01-01T00:00:00Z" in caplog.text
        assert "takes the directory over" in caplog.text
        assert json.loads((tmp_path / LOCK_FILE).read_text())["command"] == "new"
    finally:
        lock.release()


def test_the_run_releases_its_lock_whatever_ends_it(tmp_path: Path) -> None:
    cfg = config(tmp_path)

    async def fails_after_preparing() -> None:
        async with contextlib.AsyncExitStack() as stack:
            _prepare_run_dir(cfg, stack)
            raise RuntimeError("a fault after the directory was taken")

    with pytest.raises(RuntimeError):
        asyncio.run(fails_after_preparing())
    RunLock.acquire(tmp_path / "runs" / "r", command="next").release()  # not refused: it was released


def test_a_fresh_start_moves_an_earlier_attempt_aside_but_keeps_its_own_lock_in_place(tmp_path: Path) -> None:
    run_dir = tmp_path / "runs" / "r"
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text("{}\n")  # an attempt that saved no checkpoint
    cfg = config(tmp_path)

    async def go() -> None:
        async with contextlib.AsyncExitStack() as stack:
            prepared = _prepare_run_dir(cfg, stack)
            notes = _settle_run_dir(cfg, prepared)
            assert len(notes) == 1 and "moved to" in notes[0]
            assert json.loads((run_dir / LOCK_FILE).read_text())["pid"] == os.getpid()
            with pytest.raises(ConfigError, match="in use by another live run"):
                RunLock.acquire(run_dir, command="second")  # the lock moved with nothing: still held here

    asyncio.run(go())
    [aside] = list((run_dir / "previous").iterdir())
    assert sorted(p.name for p in aside.iterdir()) == ["metrics.jsonl"]
    assert sorted(p.name for p in run_dir.iterdir()) == sorted(["config.yaml", IDENTITY_FILE, "previous", LOCK_FILE])
