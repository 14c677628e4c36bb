"""The served-policy probe and its two tests, with planted scores: (i) the served/trainer gap at the
new version within tol, (ii) tokens the trainer moved must move alike on the replica; plus the probe
built from a real chat template (seeded, a tool-call turn included) and the tolerance table."""

from __future__ import annotations

import math

import pytest

from agentrl.chat import ChatTemplate
from agentrl.orchestration.served_policy import (
    MOVED_FACTOR,
    TOLERANCES,
    build_probe,
    compare_served,
    served_tolerance,
)

TOL = 1e-3
TRAINER_V1 = [[-1.0, -2.0, -0.5], [-3.0, -0.25]]
TRAINER_V2 = [[-1.0, -2.4, -0.5], [-3.0, -0.05]]  # the step moved two tokens by 0.4 and 0.2 nats


def shifted(scores, by):
    return [[x + by for x in row] for row in scores]


def test_a_replica_serving_the_new_weights_passes_both_tests():
    check = compare_served(replica="s0", version=2, served=shifted(TRAINER_V2, 4e-4), trainer=TRAINER_V2, tol=TOL,
                           served_version=2, previous=(1, shifted(TRAINER_V1, -2e-4), TRAINER_V1))
    assert check.ok and check.reasons == ()
    assert check.gap == pytest.approx(4e-4)
    assert check.moved_tokens == 2 and check.trainer_moved == pytest.approx(0.4)
    assert check.moved_gap == pytest.approx(6e-4)  # Δserved - Δtrainer = 4e-4 - (-2e-4)


def test_a_replica_left_on_the_old_weights_fails_both_tests_and_names_itself():
    check = compare_served(replica="http://10.0.0.2:8001", version=2, served=TRAINER_V1, trainer=TRAINER_V2, tol=TOL,
                           served_version=2, previous=(1, TRAINER_V1, TRAINER_V1))
    assert not check.ok
    assert check.gap == pytest.approx(0.4) and check.gap_at == (0, 2)
    assert check.moved_tokens == 2 and check.moved_gap == pytest.approx(0.4)
    text = check.describe()
    assert text.startswith("replica http://10.0.0.2:8001 at weight version 2: FAIL")
    assert "(i) served and trainer scores differ by more than tol at version 2" in text
    assert "(ii) where the trainer's scores moved since version 1, the served scores did not move alike" in text
    assert "largest |served - trainer| logprob gap 0.4 nats at sequence 0 token 2 (tol 0.001)" in text


def test_test_two_catches_a_stale_replica_whose_gap_alone_stays_under_tol():
    # the policy moved 3 tol on one token; the stale replica differs from the trainer by 3 tol there,
    # which (i) catches; with a noise offset planted against the move, (i) alone would pass
    trainer_v2 = [[-1.0 - 3 * TOL * 1.5, -2.0]]
    trainer_v1 = [[-1.0, -2.0]]
    served_v1 = [[-1.0 - 3.9 * TOL, -2.0]]  # old weights plus an offset of the same sign
    check = compare_served(replica="s1", version=5, served=served_v1, trainer=trainer_v2, tol=TOL,
                           previous=(4, served_v1, trainer_v1))
    assert check.gap == pytest.approx(0.6 * TOL)  # (i) alone passes
    assert check.moved_tokens == 1 and check.moved_gap == pytest.approx(4.5 * TOL)
    assert not check.ok and len(check.reasons) == 1 and check.reasons[0].startswith("(ii)")


def test_moves_within_a_few_tol_are_not_tested_and_the_first_check_has_no_move_test():
    small = [[-1.0 - 0.9 * MOVED_FACTOR * TOL, -2.0]]
    check = compare_served(replica="s0", version=3, served=[[-1.0, -2.0]], trainer=small, tol=TOL,
                           previous=(2, [[-1.0, -2.0]], [[-1.0, -2.0]]))
    assert check.moved_tokens == 0 and check.moved_gap == 0.0
    assert check.reasons == ("(i) served and trainer scores differ by more than tol at version 3",)
    first = compare_served(replica="s0", version=1, served=TRAINER_V1, trainer=TRAINER_V1, tol=TOL)
    assert first.ok and first.previous_version is None
    assert "no previous version to compare moves with" in first.describe()


def test_a_replica_that_scored_at_another_version_or_gave_nan_fails():
    other = compare_served(replica="s0", version=2, served=TRAINER_V2, trainer=TRAINER_V2, tol=TOL, served_version=1)
    assert not other.ok and other.reasons == ("it scored at version 1, not 2",)
    nan = compare_served(replica="s0", version=2, served=[[-1.0, math.nan, -0.5], [-3.0, -0.05]],
                         trainer=TRAINER_V2, tol=TOL)
    assert not nan.ok and nan.gap == math.inf and nan.gap_at == (0, 2)


def test_scores_of_another_probe_or_a_bad_tol_are_refused():
    with pytest.raises(ValueError, match="the served scores has \\[2\\] scores per sequence"):
        compare_served(replica="s0", version=1, served=[[-1.0, -2.0]], trainer=[[-1.0, -2.0, -3.0]], tol=TOL)
    with pytest.raises(ValueError, match="tol must be positive, got 0"):
        compare_served(replica="s0", version=1, served=TRAINER_V1, trainer=TRAINER_V1, tol=0)


def test_tolerance_per_dtype_pair_and_the_loosest_for_an_unknown_pair():
    assert served_tolerance("float32", "float32") == 1e-3
    assert served_tolerance("bfloat16", "float32") == 5e-2
    assert served_tolerance("auto", "float32") == max(TOLERANCES.values())


def test_the_probe_is_seeded_rendered_by_the_run_template_and_holds_a_tool_call(assets):
    template = ChatTemplate.from_pretrained(assets / "tiny-random-qwen2")
    probe = build_probe(template, seed=7)
    assert probe == build_probe(template, seed=7) and probe != build_probe(template, seed=8)
    assert len(probe.sequences) == 3 and probe.with_tool_turn
    text = template.tokenizer.decode(list(probe.sequences[0]))
    assert "<tool_call>" in text and '"name": "python"' in text and "<tool_response>" in text
    assert text.count("<|im_start|>assistant") == 2
    assert probe.scored_tokens == sum(len(s) for s in probe.sequences) - 3
    assert all(20 < len(s) < 400 for s in probe.sequences)
    # a context shorter than a sequence: its last ids, the turns (the tool definitions come first)
    short = build_probe(template, seed=7, max_len=96)
    assert [len(s) for s in short.sequences] == [min(96, len(s)) for s in probe.sequences]
    assert all(c == s[-len(c):] for c, s in zip(short.sequences, probe.sequences, strict=True))
    assert "<tool_response>" in template.tokenizer.decode(list(short.sequences[0]))
    with pytest.raises(ValueError, match="max_len must be >= 2"):
        build_probe(template, seed=7, max_len=1)


def test_the_probe_as_trajectories_puts_every_id_after_the_first_in_the_loss():
    from agentrl.orchestration.served_policy import probe_trajectories
    from agentrl.trainer.packing import pad_trajectories

    trajs = probe_trajectories([(5, 6, 7), (8, 9)])
    for t in trajs:
        t.validate()
    # the trainer's shifted rows: position j scores id j + 1, so every id after the first is in the loss
    assert pad_trajectories(trajs).loss_mask.tolist() == [[1, 1, 0], [1, 0, 0]]


class FakeTrainer:
    def __init__(self, scores):
        self.scores = scores
        self.probe = None

    async def set_probe(self, sequences):
        assert [len(s) - 1 for s in sequences] == [len(r) for r in self.scores]
        self.probe = sequences

    async def probe_scores_at(self, version):
        assert self.probe is not None, "the probe is set before its scores are asked for"
        return self.scores


class FakeFleet:
    """A router over replicas whose scores are planted per probe sequence: `score` by name and `admit`."""

    def __init__(self, answers, *, silent=(), broken=()):
        from types import SimpleNamespace

        self.answers = answers  # replica -> (version, [scores per sequence])
        self.silent = set(silent)  # replicas that do not answer
        self.broken = set(broken)  # replicas that answer that they cannot score
        self.servers = [SimpleNamespace(server_id=r, healthy=True, restarting=False, given_up=None) for r in answers]
        self.sequences: list[tuple[int, ...]] = []
        self.admitted: list[tuple[str, int]] = []

    async def score(self, token_ids, *, start=1, server_id):
        from agentrl.errors import ServerUnavailableError
        from agentrl.inference.protocol import ScoreResponse

        if server_id in self.silent:
            raise ServerUnavailableError(f"{server_id} refused the connection")
        if server_id in self.broken:
            from agentrl.errors import InferenceError

            raise InferenceError("the colocated vLLM engine failed: its weights are released")
        if tuple(token_ids) not in self.sequences:
            self.sequences.append(tuple(token_ids))
        version, scores = self.answers[server_id]
        return ScoreResponse(logprobs=scores[self.sequences.index(tuple(token_ids))], weight_version=version)

    def admit(self, server_id, version):
        self.admitted.append((server_id, version))


def test_the_check_after_a_push_stops_on_the_replica_left_behind_and_keeps_the_good_ones():
    import asyncio

    from agentrl.errors import ServedPolicyError
    from agentrl.orchestration.served_policy import ServedPolicyCheck, ServedProbe

    probe = ServedProbe(((1, 2, 3, 4), (5, 6, 7)), seed=0, with_tool_turn=True)
    check = ServedPolicyCheck(probe, TOL, resume_command="agentrl run runs/x/config.yaml resume=true run.name=x")
    fleet = FakeFleet({"a": (1, TRAINER_V1), "b": (1, TRAINER_V1)})
    trainer = FakeTrainer(TRAINER_V1)
    first = asyncio.run(check.after_push(1, router=fleet, trainer=trainer))
    assert [c.ok for c in first] == [True, True] and set(check.last) == {"a", "b"}
    assert fleet.admitted == [("a", 1), ("b", 1)]
    fleet = FakeFleet({"a": (2, TRAINER_V2), "b": (2, TRAINER_V1)})  # b reports version 2, serves version 1
    with pytest.raises(ServedPolicyError) as stopped:
        trainer.scores = TRAINER_V2
        asyncio.run(check.after_push(2, router=fleet, trainer=trainer))
    assert fleet.admitted == [("a", 2)], "the replica left behind is never admitted at the new version"
    message = str(stopped.value)
    assert message.startswith("At weight version 2, 1 of 2 inference replica(s) checked do not serve")
    assert "replica b at weight version 2: FAIL" in message and "replica a" not in message
    assert "moved by more than 4 x tol since version 1" in message
    assert message.endswith("resume with: agentrl run runs/x/config.yaml resume=true run.name=x")
    assert check.last["a"][0] == 2 and check.last["b"][0] == 1  # a failed replica keeps its last good scores


def test_a_replica_that_does_not_answer_is_left_out_and_one_that_comes_back_is_checked_against_the_kept_scores():
    import asyncio

    from agentrl.errors import ServedPolicyError
    from agentrl.orchestration.served_policy import ServedPolicyCheck, ServedProbe

    probe = ServedProbe(((1, 2, 3, 4), (5, 6, 7)), seed=0, with_tool_turn=True)
    check = ServedPolicyCheck(probe, TOL)
    fleet = FakeFleet({"a": (1, TRAINER_V1), "b": (1, TRAINER_V1)}, silent={"b"})
    checks = asyncio.run(check.after_push(1, router=fleet, trainer=FakeTrainer(TRAINER_V1)))
    assert [c.replica for c in checks] == ["a"] and fleet.admitted == [("a", 1)]
    # b comes back: checked against the trainer's scores kept from the push's check, no trainer call needed
    fleet.silent.clear()
    back = asyncio.run(check.verify_replica("b", 1, router=fleet))
    assert back is not None and back.ok and fleet.admitted[-1] == ("b", 1)
    assert asyncio.run(check.verify_replica("b", 2, router=fleet)) is None, "a version not checked yet waits for it"
    # b comes back again, serving other weights: not admitted, and the failure is kept for the run to raise
    fleet.answers["b"] = (1, TRAINER_V2)
    again = asyncio.run(check.verify_replica("b", 1, router=fleet))
    assert again is not None and not again.ok and fleet.admitted[-1] == ("b", 1) and len(fleet.admitted) == 2
    with pytest.raises(ServedPolicyError, match="replica b at weight version 1: FAIL"):
        check.raise_if_failed()


def test_a_replica_that_answers_it_cannot_score_fails_the_check_naming_why():
    import asyncio

    from agentrl.errors import ServedPolicyError
    from agentrl.orchestration.served_policy import ServedPolicyCheck, ServedProbe

    probe = ServedProbe(((1, 2, 3, 4), (5, 6, 7)), seed=0, with_tool_turn=True)
    fleet = FakeFleet({"a": (1, TRAINER_V1), "b": (1, TRAINER_V1)}, broken={"b"})
    with pytest.raises(ServedPolicyError) as stopped:
        asyncio.run(ServedPolicyCheck(probe, TOL).after_push(1, router=fleet, trainer=FakeTrainer(TRAINER_V1)))
    assert fleet.admitted == [("a", 1)]
    assert ("replica b at weight version 1: FAIL (it could not score the probe: the colocated vLLM engine failed: "
            "its weights are released)") in str(stopped.value)
