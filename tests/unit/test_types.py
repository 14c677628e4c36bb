"""The token ledger and the small value types."""

from __future__ import annotations

import pytest

from agentrl.types import (
    Action,
    ExecResult,
    FinishReason,
    Generation,
    SamplingParams,
    Segment,
    TokenOrigin,
    ToolCall,
    Trajectory,
    final_segments,
    is_final_segment,
    is_first_segment,
)


def _two_turn_ledger() -> Trajectory:
    t = Trajectory(episode_id="e1")
    t.extend([1, 2, 3], TokenOrigin.PROMPT, turn=0)
    t.extend([10, 11], TokenOrigin.SAMPLED, turn=1, logprobs=[-0.5, -1.0], version=3)
    t.extend([4], TokenOrigin.TEMPLATE, turn=1)
    t.extend([20, 21], TokenOrigin.TOOL, turn=1)
    t.extend([12], TokenOrigin.SAMPLED, turn=2, logprobs=[-0.25], version=4)
    return t


def test_ledger_records_origin_turn_logprob_and_version_per_token() -> None:
    t = _two_turn_ledger()
    t.validate()
    assert t.token_ids == [1, 2, 3, 10, 11, 4, 20, 21, 12]
    assert t.response_mask == [0, 0, 0, 1, 1, 0, 0, 0, 1]
    assert t.turns == [0, 0, 0, 1, 1, 1, 1, 1, 2]
    assert t.logprobs == [0, 0, 0, -0.5, -1.0, 0, 0, 0, -0.25]
    assert t.versions == [-1, -1, -1, 3, 3, -1, -1, -1, 4]
    assert t.prompt_length == 3
    assert t.num_sampled == 3
    assert t.num_turns == 2
    assert t.tokens_of(TokenOrigin.TOOL) == [20, 21]


def test_sampled_tokens_need_logprobs_and_version() -> None:
    t = Trajectory()
    with pytest.raises(ValueError, match="need 2 rollout logprobs, got none"):
        t.extend([1, 2], TokenOrigin.SAMPLED, turn=1, version=0)
    with pytest.raises(ValueError, match="policy version"):
        t.extend([1], TokenOrigin.SAMPLED, turn=1, logprobs=[-1.0])
    with pytest.raises(ValueError, match="only sampled tokens carry logprobs"):
        t.extend([1], TokenOrigin.TOOL, turn=1, logprobs=[-1.0])
    assert len(t) == 0  # a refused extend leaves the ledger untouched


def test_validate_catches_a_corrupted_ledger() -> None:
    t = _two_turn_ledger()
    t.origins.pop()
    with pytest.raises(ValueError, match="per-token lists"):
        t.validate()
    t = _two_turn_ledger()
    t.logprobs[0] = -0.1
    with pytest.raises(ValueError, match="non-sampled token 0"):
        t.validate()
    t = _two_turn_ledger()
    t.turns[4] = 0
    with pytest.raises(ValueError, match="never decrease"):
        t.validate()


def test_infra_failures_are_not_trainable_and_round_trip_through_dict() -> None:
    t = _two_turn_ledger()
    t.finish_reason, t.fault, t.reward = FinishReason.ERROR, "infra", 0.0
    assert not t.trainable
    back = Trajectory.from_dict(t.to_dict())
    assert back == t
    assert back.finish_reason is FinishReason.ERROR
    t.fault = "model"
    assert t.trainable


def test_segment_is_a_typed_field_that_round_trips_and_reads_the_old_info_entry() -> None:
    first, last, whole = _two_turn_ledger(), _two_turn_ledger(), _two_turn_ledger()
    first.segment, last.segment = Segment(index=0, of=2), Segment(index=1, of=2)
    assert [is_first_segment(t) for t in (first, last, whole)] == [True, False, True]
    assert [is_final_segment(t) for t in (first, last, whole)] == [False, True, True]
    assert final_segments([first, last, whole]) == [last, whole]
    d = last.to_dict()
    assert d["segment"] == {"index": 1, "of": 2}
    assert Trajectory.from_dict(d) == last
    # A dict written before the field existed kept the segment in info.
    old = d | {"segment": None, "info": {"segment": {"index": 1, "of": 2}, "tools": []}}
    back = Trajectory.from_dict(old)
    assert back.segment == Segment(index=1, of=2) and back.info == {"tools": []}
    with pytest.raises(ValueError, match="segment index"):
        Segment(index=2, of=2)


def test_value_types_check_their_input() -> None:
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="2 tokens but 1 logprobs"):
        Generation(token_ids=[1, 2], logprobs=[-1.0], finish_reason="stop")
    assert ExecResult("", "", 0).ok and not ExecResult("", "", 0, killed_reason="output").ok
    call = ToolCall("calculator", {"expression": "1+1"}, id="c1")
    msg = Action("hi", (call,)).to_message()
    assert msg == {
        "role": "assistant",
        "content": "hi",
        "tool_calls": [{"id": "c1", "type": "function",
                        "function": {"name": "calculator", "arguments": {"expression": "1+1"}}}],
    }


def test_kept_sets_are_stored_per_sampled_token_and_checked() -> None:
    t = Trajectory()
    t.extend([5, 6], TokenOrigin.PROMPT, 0)
    t.extend([7, 8], TokenOrigin.SAMPLED, 1, logprobs=[-0.1, -0.2], version=0, kept_sets=[[7, 9], []])
    t.extend([1], TokenOrigin.TOOL, 1)
    t.extend([3], TokenOrigin.SAMPLED, 2, logprobs=[-0.3], version=1, kept_sets=[[2, 3]])
    t.validate()
    assert t.kept_sets == [[7, 9], [], [2, 3]] and t.kept_set_overflows == 1
    assert Trajectory.from_dict(t.to_dict()) == t
    with pytest.raises(ValueError, match="without kept sets"):
        t.extend([4], TokenOrigin.SAMPLED, 3, logprobs=[-0.1], version=1)
    with pytest.raises(ValueError, match="need 1 kept sets"):
        t.extend([4], TokenOrigin.SAMPLED, 3, logprobs=[-0.1], version=1, kept_sets=[[4], [4]])
    with pytest.raises(ValueError, match="only sampled tokens"):
        t.extend([4], TokenOrigin.TOOL, 3, kept_sets=[[4]])
    t.kept_sets[0] = [9]  # the sampled token 7 is not in its own set
    with pytest.raises(ValueError, match="not in its own kept set"):
        t.validate()
    plain = Trajectory()
    plain.extend([5], TokenOrigin.PROMPT, 0)
    plain.extend([7], TokenOrigin.SAMPLED, 1, logprobs=[-0.1], version=0)
    with pytest.raises(ValueError, match="follow tokens sampled without"):
        plain.extend([8], TokenOrigin.SAMPLED, 1, logprobs=[-0.1], version=0, kept_sets=[[8]])
    assert plain.kept_sets == []


def test_sampling_params_know_when_they_truncate_the_vocabulary() -> None:
    assert not SamplingParams().truncates
    assert SamplingParams(top_p=0.9).truncates and SamplingParams(top_k=20).truncates
    assert SamplingParams(min_p=0.05).truncates
    assert not SamplingParams(temperature=0.0, top_k=20).truncates  # greedy is never replayed
    with pytest.raises(ValueError, match="min_p"):
        SamplingParams(min_p=1.0)


def test_seat_teacher_logprobs_and_turn_rewards_are_typed_checked_and_round_trip() -> None:
    t = _two_turn_ledger()
    sampled = int(TokenOrigin.SAMPLED)
    t.seat = "solver"
    t.teacher_logprobs = [-0.25 if o == sampled else 0.0 for o in t.origins]
    t.turn_rewards = [None, 0.5][: t.num_turns]
    t.validate()
    assert Trajectory.from_dict(t.to_dict()) == t
    # A dict written before the fields existed reads as unused.
    old = {k: v for k, v in t.to_dict().items() if k not in ("seat", "teacher_logprobs", "turn_rewards")}
    back = Trajectory.from_dict(old)
    assert (back.seat, back.teacher_logprobs, back.turn_rewards) == (None, [], [])

    bad = Trajectory.from_dict(t.to_dict())
    bad.teacher_logprobs = bad.teacher_logprobs[:-1]
    with pytest.raises(ValueError, match="teacher logprobs"):
        bad.validate()
    bad.teacher_logprobs = [0.0 if o == sampled else -1.0 for o in t.origins]
    with pytest.raises(ValueError, match="only sampled tokens are scored"):
        bad.validate()
    bad.teacher_logprobs = [float("nan") if o == sampled else 0.0 for o in t.origins]
    with pytest.raises(ValueError, match="finite and <= 0"):
        bad.validate()
    bad.teacher_logprobs = []
    bad.turn_rewards = [0.0] * (t.num_turns + 1)
    with pytest.raises(ValueError, match="turn_rewards\\[k - 1\\]"):
        bad.validate()
    bad.turn_rewards = [float("inf")]
    with pytest.raises(ValueError, match="turn 1's reward"):
        bad.validate()
