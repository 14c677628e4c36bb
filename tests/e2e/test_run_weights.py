"""Weights in a real `agentrl run`: every push verified by the server, the policy exported as a model.

Short runs of the tiny random Qwen2 (ParityEnv, as in test_run.py) against the session's vLLM
server, once with each engine a run can use (`files`: `weights/version-N` directories the server
reads; `http`: the server pulls the buckets from the trainer actor's endpoint). Checked: the
driver's log and the server's counters show every pushed bucket verified, the server serves each
new version, and `weights/version-N` is a complete Hugging Face directory (config, generation
config, tokenizer, the run's chat template) holding the trained weights, which `agentrl eval
model.path=...` (here with the `hf` engine, which loads the directory with `from_pretrained`)
loads and evaluates. The served-policy check after each push finds nothing (`served/gap_max`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

pytestmark = pytest.mark.slow

STOP_IDS = list(range(0, 151_000, 10))


@pytest.fixture(scope="module")
def server(vllm_server, assets):
    yield vllm_server

    async def restore() -> None:  # later tests expect the base weights
        from agentrl.inference import HTTPServerClient

        client = HTTPServerClient(vllm_server.url)
        await client.update_weights(str(assets / "tiny-random-qwen2"), 0)
        await client.aclose()

    asyncio.run(restore())
    import ray

    ray.shutdown()


def _metrics(url: str):
    from agentrl.inference import HTTPServerClient

    async def go():
        client = HTTPServerClient(url)
        try:
            return await client.metrics()
        finally:
            await client.aclose()

    return asyncio.run(go())


@pytest.mark.parametrize("backend", ["files", "http"])
def test_a_run_verifies_every_push_and_exports_a_model_that_eval_loads(tmp_path, server, assets, backend):
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from agentrl.chat import ChatTemplate
    from agentrl.config import load_config
    from agentrl.models import TOOL_CHATML_TEMPLATE
    from agentrl.orchestration.driver import run_training
    from agentrl.orchestration.evaluate import run_eval

    logging.getLogger("agentrl").setLevel(logging.INFO)  # as the CLI sets it, so driver.log has the pushes
    tiny = str(assets / "tiny-random-qwen2")
    before = _metrics(server.url)
    config = load_config(None, [
        "env=parity_env:ParityEnv", f"model.path={tiny}", "model.chat_template=chatml-tools",
        f"inference.urls=[{server.url}]", f"weights.backend={backend}", "weights.bucket_mb=1",
        "data.prompts_per_step=2", "rollout.samples_per_prompt=4", "rollout.max_tokens_per_turn=7",
        "rollout.max_turns=1", "rollout.max_total_tokens=256", "trainer.lr=1e-2", "trainer.device=cpu",
        "run.total_steps=2", "run.save_every=1", "run.eval_every=0", "data.num_val_rows=1", "eval.k=1",
        f"run.output_dir={tmp_path}", f"run.name={backend}", f"rollout.extra_stop_token_ids={STOP_IDS}",
    ])  # fmt: skip
    result = run_training(config)
    assert result.steps_done == 2 and result.policy_version == 2
    # Parity rewards an even-length answer: 4 samples capped at an odd length make a group with no reward
    # spread (and so no gradient) rare; both steps' groups flat would leave nothing to export but the start.
    grad = [m.get("actor/grad_norm", 0.0) for m in map(json.loads, (Path(result.run_dir) / "metrics.jsonl").open())]
    assert any(g > 0 for g in grad), grad
    run_dir = Path(result.run_dir)
    # The served-policy check ran after each push and found the server serving the trainer's weights
    # (a failure would have stopped the run): gaps within float32's tol (docs/served-policy.md).
    served = [m["served/gap_max"] for m in map(json.loads, (run_dir / "metrics.jsonl").open())]
    assert len(served) == 2 and all(0.0 <= g <= 1e-3 for g in served), served

    # Every push was verified by the server, bucket by bucket.
    log = (run_dir / "driver.log").read_text()
    pushes = re.findall(r"weight version (\d+) on 1 server\(s\) from (\S+): (\d+) bucket\(s\) verified of (\d+)", log)
    # (version 0 first when the shared server held another run's weights: the run serves its own)
    assert [int(v) for v, *_ in pushes] in ([1, 2], [0, 1, 2]), log
    for _, source, verified, total in pushes:
        assert int(verified) == int(total) > 1
        assert source.startswith("http://") if backend == "http" else source.startswith(str(run_dir / "weights"))
    after = _metrics(server.url)
    assert after.weight_buckets_verified - before.weight_buckets_verified == sum(int(p[2]) for p in pushes)
    assert after.weight_updates - before.weight_updates == len(pushes)  # 2, or 3 with the version-0 sync

    # The policy of every checkpoint is a complete HF directory with the trained weights.
    final = run_dir / "weights" / "version-00000002"
    names = {p.name for p in final.iterdir()}
    assert {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
            "model.safetensors.index.json"} <= names, names
    assert (run_dir / "weights" / "version-00000001").is_dir()  # checkpoint versions are kept
    assert ChatTemplate.from_pretrained(final).tokenizer.chat_template == TOOL_CHATML_TEMPLATE
    index = json.loads((final / "model.safetensors.index.json").read_text())
    assert index["metadata"]["agentrl"]["version"] == 2
    trained = AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32).state_dict()
    original = load_file(str(assets / "tiny-random-qwen2" / "model.safetensors"))
    changed = [n for n, t in original.items() if not torch.equal(trained[n], t.float())]
    assert changed, "the exported directory must hold the trained weights, not the initial ones"

    # `agentrl eval model.path=runs/NAME/weights/version-N` loads and scores that policy.
    report = run_eval(load_config(None, [
        "env=parity_env:ParityEnv", f"model.path={final}", "inference.engine=hf", "eval.k=1", "eval.max_rows=2",
        "rollout.max_tokens_per_turn=8", "rollout.max_turns=1", "rollout.max_total_tokens=256",
        f"rollout.extra_stop_token_ids={STOP_IDS}", f"eval.output_dir={tmp_path / 'eval'}",
    ]))  # fmt: skip
    assert report.problems == 2 and report.episodes == 2 and report.infra_failed_episodes == 0
    assert report.pass_at_1 is not None and report.mean_sampled_tokens > 0
    assert report.model.endswith("version-00000002")
