"""Pre-flight: what building a job cannot show is checked before anything starts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agentrl.config import load_config
from agentrl.errors import PreflightError
from agentrl.orchestration.build import build_job
from agentrl.orchestration.preflight import preflight, run_checks

DATA = Path(__file__).resolve().parents[1] / "data" / "verl"


def job_for(tmp_path: Path, *overrides: str):
    return build_job(load_config(None, ["env=arithmetic", f"run.output_dir={tmp_path}", *overrides]), "run")


def checks_by_name(job) -> dict:
    return {c.name: c for c in run_checks(job)}


def test_published_rows_pass_and_a_mis_keyed_dataset_is_named(tmp_path: Path) -> None:
    good = checks_by_name(job_for(tmp_path, f"data.train_files=[{DATA / 'gsm8k.jsonl'}]"))
    assert good["dataset"].ok, good["dataset"].detail
    assert "rows' own answers score 1.0" in good["dataset"].detail
    rows = [json.loads(line) for line in (DATA / "gsm8k.jsonl").read_text().splitlines() if line.strip()]
    rows[1]["reward_model"]["ground_truth"] = "seventy-two"  # an answer the GSM8K scorer cannot read
    bad_file = tmp_path / "miskeyed.jsonl"
    bad_file.write_text("".join(json.dumps(r) + "\n" for r in rows))
    job = job_for(tmp_path, f"data.train_files=[{bad_file}]")
    bad = checks_by_name(job)["dataset"]
    assert not bad.ok and f"{bad_file} row 1" in bad.detail and "seventy-two" in bad.detail
    with pytest.raises(PreflightError, match="Pre-flight found 1 problem"):
        preflight(job)


def test_memory_and_disk_plans_are_reported(tmp_path: Path) -> None:
    checks = checks_by_name(job_for(tmp_path))
    assert checks["memory"].ok and "trainer" in checks["memory"].detail and "server 0" in checks["memory"].detail
    assert checks["disk"].ok and "checkpoints" in checks["disk"].detail
    assert "sandbox (local)" not in checks  # arithmetic runs no code


def test_vllm_on_cpu_needs_a_cpp_compiler_and_python_headers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's CPU sampler is compiled by torch.compile at the first request: without a compiler (a fresh
    Debian machine has none) the engine dies on the first token, so pre-flight refuses first."""
    import shutil
    import sys

    from agentrl.orchestration.preflight import _cpu_compiler_problem

    if shutil.which("g++") is None:
        pytest.skip("no g++ on this machine")
    assert _cpu_compiler_problem(sys.executable) == ""  # this machine has both (scripts/install.sh)
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    assert "does not run" in _cpu_compiler_problem(sys.executable)
    failing = tmp_path / "cxx"
    failing.write_text("#!/bin/sh\necho 'fatal error: Python.h: No such file or directory' >&2\nexit 1\n")
    failing.chmod(0o755)
    monkeypatch.setenv("CXX", str(failing))
    problem = _cpu_compiler_problem(sys.executable)
    assert "cannot compile against the Python headers" in problem and "Python.h" in problem


def test_an_eval_given_its_own_client_checks_no_engine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`run_eval(config, client=...)` starts no server: the engine's probes (a python importing torch, a
    compiler run) are not run, and a machine without the engine is not refused for it."""
    from agentrl.orchestration import preflight as preflight_module

    def no_probe(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"probed the engine: {args}")

    monkeypatch.setattr(preflight_module, "run_probe", no_probe)
    config = load_config(None, ["env=arithmetic", "inference.engine=vllm", f"eval.output_dir={tmp_path}"])
    inference = checks_by_name(build_job(config, "eval", own_client=True))["inference"]
    assert (inference.ok, inference.detail) == (True, "the caller's own client generates; no engine is started")


def test_a_vllm_python_is_started_once_to_ask_whether_vllm_imports_and_where_torch_has_its_headers(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Pre-flight asks AGENTRL_VLLM_PYTHON both questions in one interpreter start (each start imports
    torch: seconds on every run); a vLLM that does not import, or a torch without headers to compile
    against, is still named."""
    from agentrl.child_process import ProbeResult
    from agentrl.orchestration import preflight as module

    started: list[list[str]] = []
    answer = {"returncode": 0, "stdout": "INFO vllm says hello\n/usr/include/python3.11\n", "stderr": ""}

    def fake_probe(argv, *, timeout_s, input=None, **_):
        started.append(list(argv))
        if argv[0] == "/venv-vllm/bin/python":
            return ProbeResult(list(argv), answer["returncode"], answer["stdout"], answer["stderr"], False, timeout_s)
        return ProbeResult(list(argv), 0, "", "", False, timeout_s)  # the compiler: the headers compile

    monkeypatch.setattr(module, "run_probe", fake_probe)
    monkeypatch.setenv("AGENTRL_VLLM_PYTHON", "/venv-vllm/bin/python")
    monkeypatch.setenv("CXX", "/usr/bin/g++")
    job = job_for(tmp_path, "inference.engine=vllm")
    check = module._check_inference(job)
    assert check.ok and check.detail == "vLLM imports under AGENTRL_VLLM_PYTHON=/venv-vllm/bin/python"
    pythons = [argv for argv in started if argv[0] == "/venv-vllm/bin/python"]
    assert len(pythons) == 1 and "import vllm" in pythons[0][2] and "sysconfig" in pythons[0][2]
    assert started[-1][:2] == ["/usr/bin/g++", "-x"] and "-I/usr/include/python3.11" in started[-1]

    answer.update(returncode=1, stdout="", stderr="ModuleNotFoundError: No module named 'vllm'")
    check = module._check_inference(job)
    assert not check.ok and check.detail == "vLLM does not import under AGENTRL_VLLM_PYTHON=/venv-vllm/bin/python"


def test_a_tensor_parallel_size_that_does_not_split_the_model_is_refused_before_anything_starts(
        tmp_path: Path, assets: Path) -> None:
    """SmolLM2-135M has 9 attention heads and 3 key/value heads: trainer.tensor_parallel=2 cannot split
    them. `build_job` (validate, run) says so, naming the key, instead of a trainer dying at start."""
    import shutil

    from agentrl.errors import ConfigError

    pytest.importorskip("megatron.core", reason="needs megatron-core: pip install 'agentrl[megatron]'")
    model = tmp_path / "model"
    shutil.copytree(assets / "tiny-random-qwen2", model)
    config = json.loads((model / "config.json").read_text())
    config.update(num_attention_heads=9, num_key_value_heads=3, intermediate_size=192, vocab_size=151938)  # only read
    (model / "config.json").write_text(json.dumps(config))
    megatron = ("trainer.backend=megatron", f"model.path={model}", "model.chat_template=chatml-tools")
    with pytest.raises(ConfigError, match=r"trainer.tensor_parallel=2 does not divide the model's attention heads \(9\)"):
        job_for(tmp_path, *megatron, "trainer.tensor_parallel=2", "trainer.num_processes=2")
    assert job_for(tmp_path, *megatron, "trainer.tensor_parallel=3", "trainer.num_processes=3").plan is not None


def _rows_with_one_long_prompt(tmp_path: Path, repeat: int) -> Path:
    rows = [json.loads(line) for line in (DATA / "gsm8k.jsonl").read_text().splitlines() if line.strip()]
    rows[2]["prompt"][0]["content"] = "Count the clips again. " * repeat + rows[2]["prompt"][0]["content"]
    path = tmp_path / "long.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_rows_whose_prompt_leaves_no_room_to_sample_are_named_before_anything_starts(tmp_path: Path) -> None:
    path = _rows_with_one_long_prompt(tmp_path, 60)
    job = job_for(tmp_path, f"data.train_files=[{path}]", "rollout.max_total_tokens=512")
    env = job.make_env()
    # The prompt as the AgentLoop's reset renders it: the env's first messages and tool schemas.
    lengths = [len(job.template.encode_prompt(env.initial_messages(r), env.prompt_tools())) for r in job.train_rows]
    env.close()
    assert lengths[0] < 512 and lengths[1] < 512 and lengths[2] >= 512
    check = checks_by_name(job)["prompt lengths"]
    assert check.ok and check.warning
    assert check.detail == (f"1 of 3 rows have prompts over rollout.max_total_tokens=512 tokens (longest: "
                            f"{lengths[2]}); they will be filtered")
    assert check.line().startswith("[warn] prompt lengths: 1 of 3 rows")
    preflight(job)  # a warning does not stop the run

    every = checks_by_name(job_for(tmp_path, f"data.train_files=[{path}]", "rollout.max_total_tokens=128"))
    assert not every["prompt lengths"].ok
    assert every["prompt lengths"].detail.startswith("3 of 3 rows have prompts over rollout.max_total_tokens=128")
    assert "raise rollout.max_total_tokens" in every["prompt lengths"].fix

    fits = checks_by_name(job_for(tmp_path, f"data.train_files=[{path}]", "rollout.max_total_tokens=2048"))
    assert fits["prompt lengths"].ok and not fits["prompt lengths"].warning
    assert fits["prompt lengths"].detail.endswith(f"is {lengths[2]} tokens, under rollout.max_total_tokens=2048")


def test_an_openenv_server_that_does_not_answer_is_named_before_anything_starts(tmp_path: Path) -> None:
    """`env.kwargs.url` is asked for /health at pre-flight; an env with nothing outside adds no line."""
    import socket
    import threading
    from http.server import BaseHTTPRequestHandler, HTTPServer

    pytest.importorskip("openenv.core")
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    job = job_for(tmp_path, "env=openenv", f"env.kwargs.url=http://127.0.0.1:{closed}", "inference.engine=hf")
    check = checks_by_name(job)["env (openenv)"]
    assert not check.ok and f"the OpenEnv server at http://127.0.0.1:{closed} did not answer" in check.detail
    with pytest.raises(PreflightError, match="start the env's server, or fix its address in env.kwargs"):
        preflight(job)

    class Health(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()
            self.wfile.write(b'{"status": "healthy"}')

        def log_message(self, *args: object) -> None:
            pass

    server = HTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"ws://127.0.0.1:{server.server_address[1]}"
        check = checks_by_name(job_for(tmp_path, "env=openenv", f"env.kwargs.url={url}", "inference.engine=hf"))
        assert check["env (openenv)"].ok and "/health" in check["env (openenv)"].detail
    finally:
        server.shutdown()
    assert "env (arithmetic)" not in checks_by_name(job_for(tmp_path))


def test_the_vllm_check_starts_no_python_when_the_answers_are_known_here(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """AGENTRL_VLLM_PYTHON naming this very interpreter: whether vLLM imports is known here, and on a
    machine without a GPU device so is where its headers are, so no python is started (only the
    compiler); with a GPU device node the python is asked about torch; another python is asked
    whether vLLM imports, and its answer decides."""
    import sys

    from agentrl.child_process import ProbeResult
    from agentrl.orchestration import preflight as module

    started: list[list[str]] = []

    def probe(argv, *, timeout_s, input=None, env=None, cwd=None):
        started.append(list(argv))
        if argv[-1].startswith("import vllm"):
            return ProbeResult(list(argv), 1, "", "ModuleNotFoundError: No module named 'vllm'", False, timeout_s)
        return ProbeResult(list(argv), 0, "cuda\n", "", False, timeout_s)  # torch sees a GPU; the compiler passes

    monkeypatch.setattr(module, "run_probe", probe)
    job = job_for(tmp_path, "inference.engine=vllm")
    # vLLM and torch are found here (after building the job: transformers asks find_spec too)
    monkeypatch.setattr(module.importlib.util, "find_spec", lambda name: object())
    monkeypatch.setenv("CXX", "fake-c++")
    monkeypatch.setenv("AGENTRL_VLLM_PYTHON", sys.executable)

    monkeypatch.setattr(module, "_gpu_device_nodes", lambda: [])
    check = module._check_inference(job)
    assert check.ok and check.detail == "vLLM imports under this python"
    assert [argv[0] for argv in started] == ["fake-c++"]  # the headers compiled; no python started

    monkeypatch.setattr(module, "_gpu_device_nodes", lambda: ["/dev/nvidiactl"])
    started.clear()
    assert module._check_inference(job).ok
    assert [argv[0] for argv in started] == [sys.executable] and "torch" in started[0][-1]  # asked about torch

    other = tmp_path / "venv" / "bin" / "python"  # the same binary in another environment is another python
    other.parent.mkdir(parents=True)
    other.symlink_to(sys.executable)
    (tmp_path / "venv" / "pyvenv.cfg").write_text("home = /usr/bin\n")
    monkeypatch.setenv("AGENTRL_VLLM_PYTHON", str(other))
    started.clear()
    check = module._check_inference(job)
    assert not check.ok and check.detail == f"vLLM does not import under AGENTRL_VLLM_PYTHON={other}"
    assert started == [[str(other), "-c", module._VLLM_PROBE]]  # one start asks both questions


def test_this_python_is_told_apart_from_others(tmp_path: Path) -> None:
    import sys

    from agentrl.orchestration.preflight import _is_this_python

    assert _is_this_python(sys.executable)
    assert not _is_this_python(str(tmp_path / "no-such-python"))
    assert not _is_this_python("/bin/sh")
