"""What a run cannot honour, `agentrl validate` refuses, naming the key.

Each example of the issue either changes what the run builds (checked on the `Job` that `validate`,
`eval` and `run` all build first) or is refused by `validate` with an AgentRLError that names the key.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from agentrl.cli import EXIT_ERROR, main
from agentrl.config import AgentRLConfig, load_config
from agentrl.errors import ConfigError
from agentrl.inference.launcher import HF_ENGINE, VLLM_ENGINE
from agentrl.inference.serve import engine_kwargs_from_config
from agentrl.orchestration.build import build_job


def refusal(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    assert main(["validate", *args]) == EXIT_ERROR
    return capsys.readouterr().err


def test_a_weight_engine_runs_cannot_use_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    err = refusal(
        capsys, "env=retool", "weights.backend=broadcast", "rollout.tool_timeout_s=1"
    )
    assert "agentrl validate: weights.backend: 'broadcast' is not wired into runs yet" in err
    assert "use 'http'" in err


@pytest.mark.docker  # the run builds a real DockerSandbox: the SDK and a daemon
def test_sandbox_and_tool_deadline_reach_the_env_the_run_builds() -> None:
    job = build_job(load_config(None, ["env=retool", "sandbox=docker", "rollout.tool_timeout_s=1"]), "run")
    try:
        from agentrl.sandboxes.docker import DockerSandbox

        env = job.make_env()
        assert isinstance(job.sandbox, DockerSandbox)
        assert env.sandbox is job.sandbox  # type: ignore[attr-defined]
        assert env.tool_timeout_s == 1.0  # type: ignore[attr-defined]
    finally:
        asyncio.run(job.aclose())


def test_a_sandbox_for_an_env_that_runs_no_code_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    err = refusal(capsys, "env=arithmetic", "sandbox=docker")
    assert "sandbox: env 'arithmetic' runs no code in a sandbox" in err


def test_read_only_paths_a_sandbox_cannot_show_are_refused_by_key(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    err = refusal(capsys, "env=retool", f"sandbox.kwargs.ro_paths=[{tmp_path}, /tmp, {tmp_path / 'gone'}]")
    assert "agentrl validate: sandbox.kwargs.ro_paths[1]: '/tmp' is the sandbox's private /tmp" in err
    assert f"sandbox.kwargs.ro_paths[2]: '{tmp_path / 'gone'}' does not exist on this machine" in err
    assert "ro_paths[0]" not in err
    err = refusal(capsys, "--eval", "env=mcp",
                  f"env.kwargs.servers=[{{command: python, args: [{tmp_path}/server.py], ro_paths: [{tmp_path}, /]}}]")
    assert "env.kwargs.servers[0].ro_paths[1]: '/' is the root: it would show the whole host" in err
    assert "ro_paths[0]" not in err


def test_a_budget_set_twice_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    err = refusal(capsys, "env=retool", "env.kwargs.tool_timeout_s=1")
    assert "env.kwargs.tool_timeout_s: the run sets this for every env through rollout.tool_timeout_s" in err


def test_the_gateway_is_the_jobs_and_not_an_env_argument(capsys: pytest.CaptureFixture[str]) -> None:
    err = refusal(capsys, "env=agent", "env.kwargs.gateway=http://elsewhere")
    assert "env.kwargs.gateway: the job gives every env that takes one its gateway" in err


def test_an_env_argument_the_env_rejects_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    err = refusal(capsys, "env=retool", "env.kwargs.split=dev")
    assert "agentrl validate: env.kwargs: env 'retool' rejected its arguments" in err
    assert "split must be 'train' or 'test', got 'dev'" in err
    assert "Traceback" not in err


def test_a_wrong_model_path_is_refused(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, assets: Path
) -> None:
    err = refusal(capsys, "env=retool", f"model.path={tmp_path / 'no-such-model'}")
    assert f"agentrl validate: model.path '{tmp_path / 'no-such-model'}' is neither a model directory" in err
    assert "AGENTRL_VLLM_PYTHON" not in err
    (tmp_path / "empty").mkdir()
    assert "has no config.json" in refusal(capsys, "env=retool", f"model.path={tmp_path / 'empty'}")
    # a tokenizer-only directory: the chat template loads, but no trainer or server could load weights
    tokenizer_only = assets / "qwen2.5-0.5b-instruct"
    err = refusal(capsys, "env=retool", f"model.path={tokenizer_only}")
    assert f"model.path '{tokenizer_only}' holds no weights" in err
    # ...which is fine for an evaluation that brings its own client
    job = build_job(
        load_config(None, ["env=retool", f"model.path={tokenizer_only}"]), "eval", own_client=True
    )
    asyncio.run(job.aclose())
    with pytest.raises(ConfigError, match="holds no weights"):
        build_job(load_config(None, ["env=retool", f"model.path={tokenizer_only}"]), "eval")


def test_trust_remote_code_reaches_the_servers_command_line() -> None:
    config = AgentRLConfig()
    assert "--trust-remote-code" not in VLLM_ENGINE.command("m", 1, **engine_kwargs_from_config(config))
    config.model.trust_remote_code = True
    for engine, spec in (("vllm", VLLM_ENGINE), ("hf", HF_ENGINE)):
        config.inference.engine = engine
        assert "--trust-remote-code" in spec.command("m", 1, **engine_kwargs_from_config(config))
    config.inference.engine = "sglang"
    assert engine_kwargs_from_config(config)["trust_remote_code"] is True


def test_the_servers_parse_trust_remote_code(monkeypatch: pytest.MonkeyPatch) -> None:
    from agentrl.inference import hf_server, vllm_server

    made: dict[str, dict] = {}

    def recorder(name: str):
        def make(model: str, **kwargs: object) -> str:
            made[name] = kwargs
            return name

        return make

    monkeypatch.setenv("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")  # vllm_server's main sets it on small machines
    monkeypatch.setattr(hf_server, "HFEngine", recorder("hf"))
    monkeypatch.setattr(vllm_server, "VLLMEngine", recorder("vllm"))
    monkeypatch.setattr(hf_server, "run_server", lambda *a, **k: None)
    monkeypatch.setattr(vllm_server, "run_server", lambda *a, **k: None)
    hf_server.main(["--model", "m", "--port", "1", "--trust-remote-code"])
    vllm_server.main(["--model", "m", "--port", "1", "--trust-remote-code"])
    assert made["hf"]["trust_remote_code"] is True and made["vllm"]["trust_remote_code"] is True
    vllm_server.main(["--model", "m", "--port", "1"])
    assert made["vllm"]["trust_remote_code"] is False


def test_trust_remote_code_reaches_the_trainer(monkeypatch: pytest.MonkeyPatch) -> None:
    from agentrl.trainer import fsdp2
    from agentrl.trainer.backend import make_backend

    given: dict[str, object] = {}
    monkeypatch.setattr(fsdp2, "FSDP2Backend", lambda *args, **kwargs: given.update(kwargs))
    config = AgentRLConfig()
    config.model.trust_remote_code = True
    make_backend(config)
    assert given["trust_remote_code"] is True


def test_the_trainer_loads_the_model_directory_it_is_given(monkeypatch: pytest.MonkeyPatch) -> None:
    from agentrl.trainer import fsdp2
    from agentrl.trainer.backend import make_backend

    given: list[object] = []
    monkeypatch.setattr(fsdp2, "FSDP2Backend", lambda *args, **kwargs: given.extend(args))
    make_backend(AgentRLConfig(), "/resolved/model")
    assert given[0] == "/resolved/model"


def test_exports_carry_the_tokenizer_and_template_the_job_built(assets: Path) -> None:
    from agentrl.orchestration.build import BUILTIN_TEMPLATES
    from agentrl.orchestration.trainer_group import export_assets

    tiny = str(assets / "tiny-random-qwen2")
    job = build_job(load_config(None, ["env=arithmetic", f"model.path={tiny}", "model.chat_template=chatml-tools"]),
                    "eval")
    own = job.template.tokenizer.chat_template
    files = export_assets(job.template, job.model_path)
    assert files["chat_template.jinja"].decode() == BUILTIN_TEMPLATES["chatml-tools"]
    assert "tokenizer.json" in files and "config.json" in files
    assert job.template.tokenizer.chat_template == own  # the run's own tokenizer is left as it was


def test_model_dtype_reaches_the_hf_engine(assets: Path) -> None:
    """`model.dtype` is the hf server's weights dtype too (it was always float32)."""
    import torch

    from agentrl.inference.hf_server import HFEngine
    from agentrl.inference.hf_server import main as hf_main

    config = AgentRLConfig()
    config.inference.engine = "hf"
    config.model.dtype = "bfloat16"
    command = HF_ENGINE.command("m", 1, **engine_kwargs_from_config(config))
    assert command[command.index("--dtype") + 1] == "bfloat16"
    engine = HFEngine(str(assets / "tiny-random-qwen2"), dtype="bfloat16")
    engine._load()
    assert {p.dtype for p in engine.model.parameters()} == {torch.bfloat16}
    assert HFEngine("m").torch_dtype() == torch.float32  # auto: this engine runs on the CPU
    with pytest.raises(ConfigError, match="model.dtype 'fp8'"):
        HFEngine("m", dtype="fp8")
    with pytest.raises(SystemExit):
        hf_main(["--model", "m", "--port", "1", "--dtype", "fp8"])


@pytest.mark.parametrize("setting", ["rollout.top_p=0.9", "rollout.top_k=20", "rollout.min_p=0.05"])
def test_truncated_sampling_on_an_engine_that_cannot_return_kept_sets_is_refused(
    capsys: pytest.CaptureFixture[str], setting: str
) -> None:
    # SGLang answers no kept sets: the trainer could not score the tokens under their distribution.
    err = refusal(capsys, "env=arithmetic", "inference.engine=sglang", setting)
    assert f"{setting}: inference.engine 'sglang' cannot return the kept set" in err
    assert "Use inference.engine=vllm or hf" in err


def test_truncated_sampling_on_an_engine_that_returns_kept_sets_validates(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["validate", "env=arithmetic", "inference.engine=hf", "rollout.top_p=0.9", "rollout.top_k=20",
                 "rollout.min_p=0.05"]) == 0
    capsys.readouterr()
    # The full vocabulary on SGLang: nothing to replay, nothing refused.
    assert main(["validate", "env=arithmetic", "inference.engine=sglang"]) == 0
