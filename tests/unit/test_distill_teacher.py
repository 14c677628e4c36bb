"""The distillation teacher: its config section, the tokenizer check at validate, and how it scores
a group (the sampled tokens filled, every other token 0.0; a teacher that fails makes the episode an
infrastructure failure naming it). A fake server (httpx MockTransport) stands in for the teacher."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import httpx
import pytest

from agentrl.config import AgentRLConfig, load_config
from agentrl.errors import ConfigError
from agentrl.inference.client import HTTPServerClient
from agentrl.orchestration.build import build_job
from agentrl.orchestration.infra import InfraMonitor
from agentrl.orchestration.teacher import Teacher, check_same_tokenizer, fill_teacher_logprobs
from agentrl.types import TokenOrigin, Trajectory


def _config(**distill: object) -> AgentRLConfig:
    return AgentRLConfig.model_validate({"distill": distill})


def test_the_section_needs_exactly_one_teacher_and_refuses_serving_keys_with_a_url() -> None:
    with pytest.raises(ValueError, match="exactly one of url"):
        _config(teacher={})
    with pytest.raises(ValueError, match="exactly one of url"):
        _config(teacher={"url": "http://127.0.0.1:1", "model_path": "m"})
    with pytest.raises(ValueError, match=r"distill\.teacher\.engine only apply to a teacher the run serves"):
        _config(teacher={"url": "http://127.0.0.1:1", "engine": "hf"})
    given = _config(teacher={"model_path": "m", "engine": "hf"}, mode="mixed", coef=0.5).distill
    assert given is not None
    assert (given.teacher.model_path, given.teacher.engine, given.mode, given.coef) == ("m", "hf", "mixed", 0.5)
    assert AgentRLConfig().distill is None
    with pytest.raises(ValueError, match="coef"):
        _config(teacher={"model_path": "m"}, coef=0.0)


def _tiny(assets: Path, tmp_path: Path, name: str) -> Path:
    out = tmp_path / name
    shutil.copytree(assets / "tiny-random-qwen2", out)
    return out


def test_a_teacher_with_the_policys_tokenizer_is_built_and_nothing_starts(assets: Path) -> None:
    tiny = str(assets / "tiny-random-qwen2")
    job = build_job(load_config(None, ["env=arithmetic", f"model.path={tiny}", "inference.engine=hf",
                                       "trainer.device=cpu", f"distill.teacher.model_path={tiny}",
                                       "distill.teacher.engine=hf"]), "run")
    try:
        assert job.teacher is not None
        assert job.teacher.model_path == tiny
        assert job.teacher.server is None  # pre-flight starts it, not the build
    finally:
        asyncio.run(job.aclose())


def test_a_teacher_whose_tokenizer_differs_is_refused_naming_both(assets: Path, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    tiny = assets / "tiny-random-qwen2"
    student = AutoTokenizer.from_pretrained(tiny)
    other_template = _tiny(assets, tmp_path, "other-template")
    config = json.loads((other_template / "tokenizer_config.json").read_text())
    config["chat_template"] = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    (other_template / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="chat template") as refused:
        check_same_tokenizer(student, AutoTokenizer.from_pretrained(other_template),
                             student_name=str(tiny), teacher_name=str(other_template))
    assert str(tiny) in str(refused.value) and str(other_template) in str(refused.value)

    bigger = AutoTokenizer.from_pretrained(tiny)
    bigger.add_tokens(["<teacher_only>"])
    with pytest.raises(ConfigError, match=r"vocabulary .*only the teacher's: \['<teacher_only>'\]"):
        check_same_tokenizer(student, bigger, student_name="s", teacher_name="t")

    # through validate: the run is refused before anything starts, both models named
    with pytest.raises(ConfigError, match=f"the teacher {other_template} does not share the policy's tokenizer "
                                          f"\\({tiny}\\)"):
        build_job(load_config(None, ["env=arithmetic", f"model.path={tiny}", "inference.engine=hf",
                                     "trainer.device=cpu", f"distill.teacher.model_path={other_template}"]), "run")


def test_distillation_with_a_critic_or_with_group_filtering_alone_is_refused(assets: Path) -> None:
    tiny = str(assets / "tiny-random-qwen2")
    base = ["env=arithmetic", f"model.path={tiny}", "inference.engine=hf", "trainer.device=cpu",
            f"distill.teacher.model_path={tiny}"]
    with pytest.raises(ConfigError, match="distill with algorithm.advantage=gae"):
        build_job(load_config(None, [*base, "algorithm.advantage=gae"]), "run")
    with pytest.raises(ConfigError, match="algorithm.filter_groups with distill.mode=advantage"):
        build_job(load_config(None, [*base, "algorithm.filter_groups=true"]), "run")


def _episode(prompt: list[int], turns: list[tuple[list[int], list[int]]]) -> Trajectory:
    """A ledger: the prompt, then per turn sampled ids and the tool ids that follow them."""
    t = Trajectory(episode_id=f"e{len(prompt)}", group_id="g", reward=1.0)
    t.extend(prompt, TokenOrigin.PROMPT, 0)
    for k, (sampled, tool) in enumerate(turns, start=1):
        t.extend(sampled, TokenOrigin.SAMPLED, k, logprobs=[-0.5] * len(sampled), version=0)
        if tool:
            t.extend(tool, TokenOrigin.TOOL, k)
    return t


def test_the_teachers_score_lands_on_sampled_tokens_only() -> None:
    t = _episode([1, 2, 3], [([4, 5], [6, 7]), ([8], [])])
    # scores of positions 3..7 (ids 4, 5, 6, 7, 8)
    filled = fill_teacher_logprobs(t, 3, [-0.1, -0.2, -0.3, -0.4, -0.5])
    assert filled == [0.0, 0.0, 0.0, -0.1, -0.2, 0.0, 0.0, -0.5]
    t.teacher_logprobs = filled
    t.validate()
    with pytest.raises(Exception, match="answered 4 logprobs for 5 positions"):
        fill_teacher_logprobs(t, 3, [-0.1, -0.2, -0.3, -0.4])
    with pytest.raises(Exception, match="logprob nan"):
        fill_teacher_logprobs(t, 3, [-0.1, float("nan"), -0.3, -0.4, -0.5])


def _teacher_on(handler) -> Teacher:  # type: ignore[no-untyped-def]
    teacher = Teacher(_config(teacher={"url": "http://teacher.test:9"}).distill.teacher)  # type: ignore[union-attr]
    teacher.client = lambda: HTTPServerClient("http://teacher.test:9", server_id="teacher",  # type: ignore[method-assign]
                                               transport=httpx.MockTransport(handler))
    return teacher


def test_a_group_is_scored_from_its_first_sampled_token() -> None:
    asked: list[dict] = []

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        asked.append(body)
        ids = body["token_ids"][body["start"]:]
        return httpx.Response(200, json={"logprobs": [-i / 100 for i in ids], "weight_version": 0})

    teacher = _teacher_on(handler)
    group = [_episode([1, 2, 3], [([4, 5], [6])]), _episode([1, 2], [([9], [])])]
    masked = _episode([1, 2], [([9], [])])
    masked.fault = "infra"
    asyncio.run(teacher.score_group([*group, masked]))
    assert sorted((a["start"], tuple(a["token_ids"])) for a in asked) == [(2, (1, 2, 9)), (3, (1, 2, 3, 4, 5, 6))]
    assert group[0].teacher_logprobs == [0.0, 0.0, 0.0, -0.04, -0.05, 0.0]
    assert group[1].teacher_logprobs == [0.0, 0.0, -0.09]
    assert masked.teacher_logprobs == []  # an episode already masked is not scored
    assert all(t.trainable for t in group)


def test_a_teacher_that_fails_makes_infra_failures_that_stop_the_run_naming_it() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused")

    teacher = _teacher_on(handler)
    group = [_episode([1, 2, 3], [([4, 5], [])]) for _ in range(4)]
    asyncio.run(teacher.score_group(group))
    assert [t.fault for t in group] == ["infra"] * 4
    assert all(t.teacher_logprobs == [] and t.reward == 1.0 for t in group)  # masked, its reward not made 0
    assert group[0].error is not None
    assert group[0].error.startswith("the distillation teacher at http://teacher.test:9 (distill.teacher.url) "
                                     "could not score the episode: ServerUnavailableError: Cannot reach")
    monitor = InfraMonitor(0.5, 8, min_episodes=4)
    monitor.record(group)
    with pytest.raises(Exception, match="distill.teacher") as stopped:
        monitor.check()
    assert "4 of the last 4 episodes" in str(stopped.value)
    assert "Fix: the teacher model (distill.teacher, named above with its log)" in str(stopped.value)


def test_a_resume_that_adds_or_changes_the_teacher_is_refused_naming_it(tmp_path: Path) -> None:
    from agentrl.orchestration.run_identity import check_resume, run_identity, write_identity

    run_dir = tmp_path / "r"
    run_dir.mkdir()
    plain = load_config(None, [])
    # an identity recorded before distillation existed had no distill keys: a plain resume still matches
    legacy = {k: v for k, v in run_identity(plain).items() if not k.startswith("distill.")}
    write_identity(run_dir, legacy)
    check_resume(load_config(None, ["resume=true"]), run_dir)
    with pytest.raises(ConfigError, match=r"distill\.teacher: null -> \"/m/teacher\"") as refused:
        check_resume(load_config(None, ["resume=true", "distill.teacher.model_path=/m/teacher"]), run_dir)
    assert "distill.mode: null -> \"advantage\"" in str(refused.value)
    allowed = check_resume(load_config(None, ["resume=true", "distill.teacher.model_path=/m/teacher",
                                              "run.resume_allow=[distill]"]), run_dir)
    assert set(allowed.allowed) == {"distill.teacher", "distill.mode", "distill.coef"}


def _preflight_job(assets: Path, teacher: Teacher):  # type: ignore[no-untyped-def]
    from types import SimpleNamespace

    from agentrl.chat import ChatTemplate
    from agentrl.models import TOOL_CHATML_TEMPLATE

    tiny = str(assets / "tiny-random-qwen2")
    template = ChatTemplate.from_pretrained(tiny, template=TOOL_CHATML_TEMPLATE)
    return SimpleNamespace(teacher=teacher, template=template, config=load_config(None, []), model_path=tiny)


def test_preflight_scores_a_probe_and_checks_the_tokenizer_a_url_teacher_serves(assets: Path) -> None:
    from agentrl.orchestration.preflight import _check_teacher

    scored: list[int] = []

    def serving(model: str):  # type: ignore[no-untyped-def]
        def handler(request: httpx.Request) -> httpx.Response:
            if request.url.path == "/health":
                return httpx.Response(200, json={"status": "ok", "weight_version": 0, "model": model,
                                                 "engine": "hf", "load": 0})
            body = json.loads(request.content)
            scored.append(len(body["token_ids"]))
            return httpx.Response(200, json={"logprobs": [-1.0] * (len(body["token_ids"]) - 1), "weight_version": 0})
        return handler

    check = _check_teacher(_preflight_job(assets, _teacher_on(serving(str(assets / "tiny-random-qwen2")))))
    assert check is not None and check.ok
    assert check.detail == (f"scored {scored[0] - 1} probe tokens (mean logprob -1.000), tokenizer of "
                            f"{assets / 'tiny-random-qwen2'} checked")
    elsewhere = _check_teacher(_preflight_job(assets, _teacher_on(serving("org/some-model"))))
    assert elsewhere is not None and elsewhere.ok
    assert "its tokenizer was not checked: it serves 'org/some-model', which is no directory here" in elsewhere.detail


def test_preflight_refuses_a_teacher_that_does_not_answer(assets: Path) -> None:
    from agentrl.orchestration.preflight import _check_teacher

    def handler(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused")

    check = _check_teacher(_preflight_job(assets, _teacher_on(handler)))
    assert check is not None and not check.ok
    assert check.detail.startswith("the distillation teacher at http://teacher.test:9 (distill.teacher.url) could "
                                   "not score a probe of ")
    assert "distill.teacher" in check.fix
