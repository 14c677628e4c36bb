"""Trajectory files: the format `agentrl eval` and each step of `agentrl run` write (trajectory_log.py).

Built from real ledgers: the Qwen2.5 chat template delta-tokenises a tool-calling episode exactly
as the AgentLoop does, so the segments, token texts and origins are those a user would see.
"""

from __future__ import annotations

import json
import math
import os
import random
import sys
from pathlib import Path

import pytest

from agentrl.chat import ChatTemplate
from agentrl.orchestration.ledger import PromptRef
from agentrl.orchestration.schedule import GroupResult
from agentrl.records.trajectory_log import (
    FORMAT,
    RolloutLog,
    TokenPieces,
    TrainerTokens,
    read_trajectory_file,
    scan_trajectory_file,
    select_groups,
    trajectory_from_record,
    trajectory_record,
    write_eval_trajectories,
)
from agentrl.types import Segment, TokenOrigin

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from viewer_runs import NOT_EPISODES, tool_episode

ASSETS = Path(os.environ.get("AGENTRL_ASSETS", "/work/shared/assets"))
QWEN25 = ASSETS / "qwen2.5-0.5b-instruct"
MISTRAL = ASSETS / "mistral-nemo-instruct-2407"

pytestmark = pytest.mark.skipif(not QWEN25.is_dir(), reason=f"tokenizer assets not found under {ASSETS}")

@pytest.fixture(scope="module")
def template() -> ChatTemplate:
    return ChatTemplate.from_pretrained(QWEN25)


def test_token_pieces_join_to_the_tokenizers_decoding() -> None:
    from transformers import AutoTokenizer

    text = "Hello wörld! 日本語のテキスト 🙂 <|im_start|>user\n  def f(x):\n\treturn x**2\n" * 5
    for path in (QWEN25, MISTRAL):
        if not path.is_dir():
            continue
        tok = AutoTokenizer.from_pretrained(path)
        ids = tok.encode(text, add_special_tokens=False)
        pieces = TokenPieces(tok)
        got = pieces(ids)
        assert len(got) == len(ids)
        assert "".join(got) == tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        assert "\ufffd" not in "".join(got)
        assert pieces(ids) == got  # the cached path gives the same


def test_record_segments_are_readable_and_give_back_the_exact_ledger(template: ChatTemplate) -> None:
    t = tool_episode(template)
    t.validate()
    record = json.loads(json.dumps(trajectory_record(t, TokenPieces(template.tokenizer), source="eval",
                                                     ground_truth="84")))
    assert record["format"] == FORMAT and record["ground_truth"] == "84"
    segments = record["segments"]
    assert [s["origin"] for s in segments] == ["prompt", "sampled", "template", "tool", "template", "sampled"]
    assert [s["turn"] for s in segments] == [0, 1, 1, 1, 1, 2]
    assert [s.get("version") for s in segments] == [None, 2, None, None, None, 3]
    assert segments[3]["text"] == "84"
    assert "calculator" in segments[1]["text"] and segments[5]["text"].startswith("The answer is")
    full = template.tokenizer.decode(t.token_ids, skip_special_tokens=False)
    assert "".join(s["text"] for s in segments) == full
    for s in segments:
        assert "".join(s["pieces"]) == s["text"] and len(s["pieces"]) == len(s["ids"])
        assert s["start"] == sum(len(x["ids"]) for x in segments[: segments.index(s)])
        assert ("logprobs" in s) == (s["origin"] == "sampled")
    assert record["num_sampled"] == t.num_sampled and record["num_turns"] == 2
    assert record["messages"][1]["tool_calls"][0]["function"]["name"] == "calculator"
    back = trajectory_from_record(record)
    assert back == t


def test_kept_sets_travel_with_their_sampled_segments_and_read_back_exactly(template: ChatTemplate) -> None:
    t = tool_episode(template)
    sampled = [tok for tok, o in zip(t.token_ids, t.origins, strict=True) if o == int(TokenOrigin.SAMPLED)]
    t.kept_sets = [[tok] if k % 3 else [] if k % 2 else sorted({tok, 7, 9}) for k, tok in enumerate(sampled)]
    t.validate()
    record = json.loads(json.dumps(trajectory_record(t, None, source="eval")))
    kept = [s.get("kept") for s in record["segments"]]
    assert [k is not None for k in kept] == [s["origin"] == "sampled" for s in record["segments"]]
    assert [x for k in kept if k is not None for x in k] == t.kept_sets
    assert trajectory_from_record(record) == t
    t.kept_sets = []  # the whole vocabulary kept: nothing written
    assert all("kept" not in s for s in trajectory_record(t, None, source="eval")["segments"])


def test_eval_file_and_legacy_file_are_read_the_same_way(template: ChatTemplate, tmp_path: Path) -> None:
    groups = [[tool_episode(template, episode_id="a"), tool_episode(template, reward=0.0, episode_id="b")]]
    rows = [{"prompt": "x", "reward_model": {"ground_truth": "84"}}]
    assert write_eval_trajectories(tmp_path / "trajectories.jsonl", groups, rows, template.tokenizer) == 2
    records = read_trajectory_file(tmp_path / "trajectories.jsonl")
    assert [r["episode_id"] for r in records] == ["a", "b"]
    assert all(r["status"] == "eval" and r["source"] == "eval" and not r["trained"] for r in records)
    # The format written before this one: Trajectory.to_dict() plus the text, origins as integers.
    old = groups[0][0].to_dict() | {"text": "whole text", "ground_truth": "84"}
    (tmp_path / "old.jsonl").write_text(json.dumps(old) + "\n" + '{"cut by a cra')
    [upgraded] = read_trajectory_file(tmp_path / "old.jsonl")
    assert upgraded["format"] == FORMAT and upgraded["text"] == "whole text" and upgraded["ground_truth"] == "84"
    assert [s["origin"] for s in upgraded["segments"]] == [s["origin"] for s in records[0]["segments"]]
    assert trajectory_from_record(upgraded) == groups[0][0]


def test_segment_has_its_own_key_and_old_files_with_it_in_info_are_read(template: ChatTemplate,
                                                                          tmp_path: Path) -> None:
    t = tool_episode(template, episode_id="a")
    t.segment = Segment(index=1, of=3)
    record = trajectory_record(t, None, source="eval")
    assert record["segment"] == {"index": 1, "of": 3} and "segment" not in record["info"]
    assert trajectory_from_record(record) == t
    assert trajectory_record(tool_episode(template), None, source="eval")["segment"] is None
    # A line written when the segment was an entry of info: read with it under its own key.
    old = record | {"info": {**record["info"], "segment": {"index": 1, "of": 3}}}
    del old["segment"]
    (tmp_path / "old.jsonl").write_text(json.dumps(old) + "\n")
    [read] = read_trajectory_file(tmp_path / "old.jsonl")
    assert read["segment"] == {"index": 1, "of": 3} and "segment" not in read["info"]
    assert trajectory_from_record(old) == t


def test_non_finite_numbers_become_null_so_browsers_can_parse_the_file(template: ChatTemplate, tmp_path: Path) -> None:
    t = tool_episode(template)
    t.metrics["ratio"] = math.nan
    t.info["nested"] = {"x": [math.inf, 1.0]}
    write_eval_trajectories(tmp_path / "t.jsonl", [[t]], [{}], template.tokenizer)
    line = (tmp_path / "t.jsonl").read_text()
    assert "NaN" not in line and "Infinity" not in line
    record = json.loads(line)
    assert record["metrics"]["ratio"] is None and record["info"]["nested"] == {"x": [None, 1.0]}


@pytest.mark.parametrize(("keep", "expected"), [
    (0, {}),
    (1, {3: ["best"], 4: ["infra"]}),
    (2, {1: ["worst"], 3: ["best"], 4: ["infra"]}),
    ("all", {i: ["all"] for i in range(6)}),
])  # fmt: skip
def test_select_groups_keeps_best_worst_and_every_infra_group(keep, expected) -> None:
    means = [0.5, 0.0, 0.5, 1.0, None, 0.0]  # group 4: every episode failed for infrastructure reasons
    infra = [False, False, False, False, True, False]
    assert select_groups(means, infra, keep, random.Random(0)) == expected


def test_select_groups_fills_up_to_n_at_random_and_marks_partly_failed_groups() -> None:
    means = [0.5, 0.0, 0.25, 1.0, 0.75, 0.5]
    infra = [False, False, True, False, False, False]
    chosen = select_groups(means, infra, 4, random.Random(3))
    assert chosen[3] == ["best"] and chosen[1] == ["worst"]
    assert "infra" in chosen[2]
    assert sum(1 for why in chosen.values() if why != ["infra"]) == 4


def test_rollout_log_writes_each_steps_sample(template: ChatTemplate, tmp_path: Path) -> None:
    def group(i: int, rewards: list[float], fault: str | None = None) -> GroupResult:
        trajs = [tool_episode(template, reward=r, episode_id=f"{i}-{j}", group_id=f"g{i}", fault=fault)
                 for j, r in enumerate(rewards)]
        return GroupResult(PromptRef(0, i), trajs, version=2)

    trained = [group(0, [1.0, 0.0]), group(1, [0.0, 0.0]), group(2, [1.0, 1.0]), group(3, [0.0, 1.0])]
    discarded = [group(4, [0.0, 0.0], fault="infra"), group(5, [1.0, 1.0])]
    rows = [{"reward_model": {"ground_truth": str(i)}} for i in range(6)]
    log = RolloutLog(tmp_path, template.tokenizer, 2, seed=7)
    path = log.write_step(4, trained, discarded, rows)
    assert path == tmp_path / "rollouts" / "step-000005.jsonl" and log.last_seconds > 0
    records = read_trajectory_file(path)
    by_group = {r["group_id"]: r for r in records}
    assert set(by_group) == {"g1", "g2", "g4"}  # worst, best, and the infra-failed group
    assert by_group["g2"]["kept_as"] == ["best"] and by_group["g1"]["kept_as"] == ["worst"]
    assert by_group["g4"]["status"] == "infra" and by_group["g4"]["kept_as"] == ["infra"]
    assert not by_group["g4"]["trained"] and by_group["g2"]["trained"]
    assert all(r["step"] == 5 and r["source"] == "train" for r in records)
    assert by_group["g4"]["ground_truth"] == "4"
    assert len(records) == 6
    # The same step of a resumed run keeps the same sample.
    again = RolloutLog(tmp_path / "again", template.tokenizer, 2, seed=7).write_step(4, trained, discarded, rows)
    assert again is not None and [r["episode_id"] for r in read_trajectory_file(again)] == [r["episode_id"] for r in records]
    everything = RolloutLog(tmp_path / "all", template.tokenizer, "all").write_step(0, trained, discarded, rows)
    assert everything is not None
    kept = read_trajectory_file(everything)
    assert len(kept) == 12 and {r["status"] for r in kept} == {"trained", "filtered", "infra"}
    assert RolloutLog(tmp_path / "none", template.tokenizer, 0).write_step(0, trained, discarded, rows) is None
    assert not (tmp_path / "none" / "rollouts").exists()


def test_every_origin_has_a_name() -> None:
    from agentrl.records.trajectory_log import ORIGIN_NAMES

    assert ORIGIN_NAMES == {int(o): o.name.lower() for o in TokenOrigin}
    assert set(ORIGIN_NAMES.values()) == {"prompt", "sampled", "template", "tool"}


def test_kept_as_is_a_sequence_of_reasons_and_the_stopped_file_says_stopped(template: ChatTemplate,
                                                                           tmp_path: Path) -> None:
    t = tool_episode(template, fault="infra")
    with pytest.raises(TypeError, match="not a bare string"):
        trajectory_record(t, None, source="train", kept_as="best")
    assert trajectory_record(t, None, source="train", kept_as=("best", "infra"))["kept_as"] == ["best", "infra"]
    path = RolloutLog(tmp_path, template.tokenizer, 0).write_stopped(2, [t, tool_episode(template, episode_id="ok")])
    assert path == tmp_path / "rollouts" / "step-000003-stopped.jsonl"
    [record] = read_trajectory_file(path)  # the infrastructure failure only
    assert (record["kept_as"], record["status"], record["step"], record["trained"]) == (["stopped"], "infra", 3, False)


def test_lines_that_are_not_episodes_are_skipped_and_counted(template: ChatTemplate, tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    write_eval_trajectories(path, [[tool_episode(template, episode_id="a"), tool_episode(template, episode_id="b")]],
                            [{}], template.tokenizer)
    good = path.read_text().splitlines()
    odd = [*NOT_EPISODES, '{"segments": [{"origin": "prompt", "turn": 0, "start": 0, "ids": "abc"}]}',
           '{"segments": [], "messages": [null]}', '{"token_ids": [1, 2], "origins": [0]}']
    assert '"reward": 1.0' in good[1]
    path.write_text("\n".join([good[0], *odd, "", good[1], good[1].replace('"reward": 1.0', '"reward": NaN')]) + "\n")
    records, skipped = scan_trajectory_file(path)
    assert [r["episode_id"] for r in records] == ["a", "b", "b"] and skipped == len(odd) == 9
    assert records[2]["reward"] is None  # NaN is read as null, as the writer writes it
    assert read_trajectory_file(path) == records


def _trainer_values(t, gap_at: int, gap: float) -> TrainerTokens:
    """The trainer's values of a ledger: the rollout's logprob on every sampled token but `gap_at`,
    where it differs by `gap`; an entropy that counts up; None on every other token."""
    sampled = int(TokenOrigin.SAMPLED)
    logprobs = [lp - (gap if i == gap_at else 0.0) if o == sampled else None
                for i, (lp, o) in enumerate(zip(t.logprobs, t.origins, strict=True))]
    entropy = [0.01 * i if o == sampled else None for i, o in enumerate(t.origins)]
    return TrainerTokens(logprobs, entropy)


def test_kept_trained_episodes_carry_the_trainers_logprob_and_entropy_beside_the_rollouts(
    template: ChatTemplate, tmp_path: Path
) -> None:
    def group(i: int, rewards: list[float], fault: str | None = None) -> GroupResult:
        trajs = [tool_episode(template, reward=r, episode_id=f"{i}-{j}", group_id=f"g{i}", fault=fault)
                 for j, r in enumerate(rewards)]
        return GroupResult(PromptRef(0, i), trajs, version=2)

    trained = [group(0, [1.0, 0.0]), group(1, [0.0, 0.0]), group(2, [1.0, 1.0]), group(3, [0.0, 1.0])]
    discarded = [group(4, [0.0, 0.0], fault="infra"), group(5, [1.0, 1.0])]
    log = RolloutLog(tmp_path, template.tokenizer, 2, seed=7)
    kept = log.kept_trained(4, trained, discarded)
    # the worst and the best trained groups (g1, g2); the infra-failed g4 was not trained
    assert [t.episode_id for t in kept] == ["1-0", "1-1", "2-0", "2-1"]
    first_sampled = kept[0].origins.index(int(TokenOrigin.SAMPLED))
    values = {id(t): _trainer_values(t, first_sampled, 0.75) for t in kept}
    asked: list[str] = []

    def trainer(t):
        asked.append(t.episode_id)
        return values.get(id(t))

    path = log.write_step(4, trained, discarded, trainer=trainer)
    assert path is not None and sorted(asked) == ["1-0", "1-1", "2-0", "2-1"]  # never asked for the infra group
    records = {r["episode_id"]: r for r in read_trajectory_file(path)}
    r = records["1-0"]
    t = kept[0]
    for seg in r["segments"]:
        if seg["origin"] != "sampled":
            assert "trainer_logprobs" not in seg and "trainer_entropy" not in seg
            continue
        start, n = seg["start"], len(seg["ids"])
        assert seg["trainer_logprobs"] == values[id(t)].logprobs[start:start + n]
        assert seg["trainer_entropy"] == pytest.approx([0.01 * i for i in range(start, start + n)])
    first = next(s for s in r["segments"] if s["origin"] == "sampled")
    assert first["logprobs"][0] - first["trainer_logprobs"][0] == pytest.approx(0.75)
    assert all("trainer_logprobs" not in s for s in records["4-0"]["segments"])  # infra: not trained, not scored
    # The line still turns back into the exact ledger; the trainer's values are beside it.
    back = trajectory_from_record(r)
    assert (back.token_ids, back.logprobs, back.origins) == (t.token_ids, t.logprobs, t.origins)
    # A ledger and values of different lengths are refused, naming both.
    with pytest.raises(ValueError, match="cover 3 tokens"):
        trajectory_record(t, None, source="train", trainer=TrainerTokens([None, None, None]))


def test_files_without_trainer_values_still_read_and_bad_ones_are_skipped(template: ChatTemplate, tmp_path: Path) -> None:
    t = tool_episode(template)
    old = trajectory_record(t, TokenPieces(template.tokenizer), source="train", step=1, status="trained")
    values = _trainer_values(t, t.origins.index(int(TokenOrigin.SAMPLED)), 0.5)
    new = trajectory_record(t, TokenPieces(template.tokenizer), source="train", step=1, status="trained", trainer=values)
    bad = json.loads(json.dumps(new))
    next(s for s in bad["segments"] if s["origin"] == "sampled")["trainer_logprobs"].pop()  # one value short
    path = tmp_path / "step-000001.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in (old, new, bad)))
    records, skipped = scan_trajectory_file(path)
    assert skipped == 1 and len(records) == 2
    assert all("trainer_logprobs" not in s for s in records[0]["segments"])
    assert any("trainer_logprobs" in s for s in records[1]["segments"])


def test_seat_turn_rewards_and_teacher_logprobs_have_their_keys_and_read_back_exactly(template: ChatTemplate) -> None:
    t = tool_episode(template)
    sampled = int(TokenOrigin.SAMPLED)
    t.seat, t.turn_rewards = "proposer", [0.25, None][: t.num_turns]
    t.teacher_logprobs = [-0.5 - 0.01 * i if o == sampled else 0.0 for i, o in enumerate(t.origins)]
    t.validate()
    record = json.loads(json.dumps(trajectory_record(t, None, source="eval")))
    assert record["seat"] == "proposer" and record["turn_rewards"] == t.turn_rewards
    teacher = [s.get("teacher_logprobs") for s in record["segments"]]
    assert [x is not None for x in teacher] == [s["origin"] == "sampled" for s in record["segments"]]
    assert trajectory_from_record(record) == t
    t.teacher_logprobs = []  # no teacher: no key, and it reads back as none
    record = trajectory_record(t, None, source="eval")
    assert all("teacher_logprobs" not in s for s in record["segments"])
    assert trajectory_from_record(record).teacher_logprobs == []
