"""Checkpoints on disk (`CheckpointStore`): written whole or not at all, checksummed, pruned,
verified at resume with a message naming the bad file, and a fallback to the newest intact one.
The trainer's part is a fake that writes files like a backend does; nothing else runs."""

from __future__ import annotations

import asyncio
import errno
import json
from pathlib import Path

import pytest

from agentrl.errors import CheckpointError
from agentrl.orchestration.checkpoints import CheckpointStore, move_aside_earlier_attempt, verify_checkpoint


def driver_state(step: int) -> dict:
    return {"steps_done": step, "trainer_version": step, "sampler": {"epoch": 0, "cursor": step},
            "ledger": {"entries": []}}


def writer(size: int = 4096, fail: BaseException | None = None):
    async def write(folder: Path) -> None:
        folder.mkdir(parents=True)
        (folder / "dcp").mkdir()
        (folder / "dcp" / "__0_0.distcp").write_bytes(bytes(range(256)) * (size // 256))
        (folder / "trainer_state.pt").write_bytes(b"meta" * 16)
        if fail is not None:
            raise fail
    return write


def save(store: CheckpointStore, step: int, **kw) -> Path:
    return asyncio.run(store.save(step, writer(**kw), driver_state(step)))


def test_a_checkpoint_is_complete_checksummed_and_pointed_at(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "checkpoints", keep=0)
    path = save(store, 1)
    assert path.name == "step-000001" and store.latest_name() == "step-000001"
    manifest = json.loads((path / "MANIFEST.json").read_text())
    assert set(manifest["files"]) == {"trainer/dcp/__0_0.distcp", "trainer/trainer_state.pt", "driver_state.json"}
    assert all(len(f["sha256"]) == 64 for f in manifest["files"].values())
    assert not list((tmp_path / "checkpoints").glob(".*tmp*")), "no temporary folder is left"
    found = store.resumable()
    assert found is not None and found.step == 1 and found.state["steps_done"] == 1


def test_older_checkpoints_are_pruned_to_keep_checkpoints(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "checkpoints", keep=2)
    for step in (1, 2, 3, 4):
        save(store, step)
    assert [p.name for _, p in store.complete()] == ["step-000003", "step-000004"]


def replaced(store: CheckpointStore) -> list[str]:
    return [p.name.split(".replaced-")[0] for p in store.replaced()]


def test_copies_of_re_saved_steps_are_pruned_under_keep_checkpoints(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "checkpoints", keep=3)
    save(store, 1)
    save(store, 2)
    save(store, 2)  # a resumed run saves the step it resumed at again: the earlier save is kept aside
    assert [p.name for _, p in store.complete()] == ["step-000001", "step-000002"] and replaced(store) == ["step-000002"]
    save(store, 2)  # twice within a second: a second copy, not one renamed onto the other
    assert replaced(store) == ["step-000002"], "keep=3 leaves room for one copy beside two checkpoints"
    save(store, 3)
    assert [p.name for _, p in store.complete()] == ["step-000001", "step-000002", "step-000003"]
    assert replaced(store) == [], "the checkpoints a resume can use come first"
    assert store.latest_name() == "step-000003" and store.resumable().step == 3


def test_keep_one_never_deletes_the_latest_and_keep_zero_keeps_every_copy(tmp_path: Path) -> None:
    one = CheckpointStore(tmp_path / "one" / "checkpoints", keep=1)
    for _ in range(3):
        save(one, 5)
    assert [p.name for _, p in one.complete()] == ["step-000005"] and replaced(one) == []
    assert sorted(p.name for p in one.directory.iterdir()) == ["latest", "step-000005"]
    every = CheckpointStore(tmp_path / "every" / "checkpoints", keep=0)
    for _ in range(3):
        save(every, 5)
    assert replaced(every) == ["step-000005", "step-000005"]


def test_a_same_size_corruption_inside_a_shard_is_found_and_an_older_checkpoint_used(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "checkpoints", keep=0)
    save(store, 1)
    newest = save(store, 2)
    shard = newest / "trainer" / "dcp" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[1000:1008] = b"\xff" * 8  # same size, different bytes
    shard.write_bytes(bytes(data))
    found = store.resumable()
    assert found is not None and found.name == "step-000001"
    assert (tmp_path / "checkpoints" / "step-000002.bad").is_dir(), "the damaged one is kept aside"
    state, problem = verify_checkpoint(tmp_path / "checkpoints" / "step-000002.bad")
    assert state is None and "__0_0.distcp does not match its SHA-256 checksum" in problem


def test_a_truncated_driver_state_is_named_and_with_no_intact_checkpoint_nothing_starts(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "checkpoints", keep=0)
    path = save(store, 1)
    state_file = path / "driver_state.json"
    state_file.write_text(state_file.read_text()[:20])
    with pytest.raises(CheckpointError) as caught:
        store.resumable()
    message = str(caught.value)
    assert "step-000001" in message and "driver_state.json has" in message and "nothing was started" in message


def test_a_full_disk_leaves_the_previous_checkpoint_intact_and_says_so(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "checkpoints", keep=0)
    save(store, 1)
    full = OSError(errno.ENOSPC, "No space left on device")
    with pytest.raises(CheckpointError) as caught:
        asyncio.run(store.save(2, writer(fail=full), driver_state(2)))
    message = str(caught.value)
    assert "disk under" in message and "is full" in message and "step-000001 is intact" in message
    assert message.endswith("continue the run with resume=true run.name=" + tmp_path.name)
    named = CheckpointStore(tmp_path / "checkpoints", keep=0, resume_command="agentrl run x resume=true run.name=mine")
    with pytest.raises(CheckpointError, match="continue with: agentrl run x resume=true run.name=mine$"):
        asyncio.run(named.save(2, writer(fail=full), driver_state(2)))
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["latest", "step-000001"]
    assert store.latest_name() == "step-000001" and store.resumable().step == 1


def test_an_earlier_attempt_without_checkpoint_is_moved_aside_not_deleted(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "ledger.jsonl").write_text('{"key": "e0-r1-a0"}\n')
    (run_dir / "metrics.jsonl").write_text('{"step": 0}\n')
    aside = move_aside_earlier_attempt(run_dir)
    assert aside is not None and aside.parent == run_dir / "previous"
    assert (aside / "ledger.jsonl").read_text() == '{"key": "e0-r1-a0"}\n'
    assert sorted(p.name for p in run_dir.iterdir()) == ["previous"]
    assert move_aside_earlier_attempt(run_dir) is None
