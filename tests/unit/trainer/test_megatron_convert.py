"""Hugging Face <-> megatron-core weight conversion: pure tensor reshapes, checked without megatron.

The round trip HF -> per-rank megatron shards -> HF must be exact for every tensor-parallel size;
the layouts themselves are checked on hand-built tensors (which rows of `linear_qkv` hold which
head, which rank holds which half of `linear_fc1`).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from agentrl.errors import ConfigError, FeatureUnavailableError
from agentrl.trainer.megatron_convert import (
    GPTLayout,
    convert_all_to_hf,
    gpt_layout_from_hf,
    hf_to_megatron,
    partition_dim,
)


def _config(kind: str = "qwen2", **kw):
    from transformers import AutoConfig

    base = dict(
        hidden_size=16, intermediate_size=24, num_attention_heads=4, num_key_value_heads=2, head_dim=4,
        num_hidden_layers=2, vocab_size=32, max_position_embeddings=64, tie_word_embeddings=False,
    )  # fmt: skip
    base.update(kw)
    return AutoConfig.for_model(kind, **base)


def _random_state(config) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for p in model.parameters():  # biases and norms start at 0 / 1: make every value distinct
            p.copy_(torch.randn_like(p))
    return model.state_dict()


def _round_trip(state: dict[str, torch.Tensor], lay: GPTLayout, tp: int) -> dict[str, torch.Tensor]:
    shards = [hf_to_megatron(state, lay, r, tp) for r in range(tp)]

    def shards_of(name: str) -> list[torch.Tensor]:
        return [s[name] for s in shards] if partition_dim(name) is not None else [shards[0][name]]

    return dict(convert_all_to_hf(list(shards[0]), shards_of, lay))


@pytest.mark.parametrize(
    ("kind", "tied", "tp"),
    [("qwen2", False, 1), ("qwen2", False, 2), ("qwen2", True, 2), ("llama", True, 1), ("llama", False, 2)],
)
def test_round_trip_is_exact(kind: str, tied: bool, tp: int) -> None:
    config = _config(kind, tie_word_embeddings=tied)
    state = _random_state(config)
    lay = gpt_layout_from_hf(config)
    assert lay.qkv_bias == (kind == "qwen2") and lay.tied_embeddings == tied
    back = _round_trip(state, lay, tp)
    assert set(back) == set(state)
    for name, tensor in state.items():
        assert torch.equal(back[name], tensor), name


def test_qkv_rows_are_grouped_per_key_value_head() -> None:
    config = _config()
    lay = gpt_layout_from_hf(config)
    state = _random_state(config)
    h = "model.layers.0.self_attn."
    q, k, v = (state[h + f"{p}_proj.weight"] for p in "qkv")
    d = lay.head_dim  # 4 query heads, 2 groups: group g = query heads 2g, 2g+1, key g, value g
    expect = torch.cat([q[0 : 2 * d], k[0:d], v[0:d], q[2 * d : 4 * d], k[d : 2 * d], v[d : 2 * d]])
    full = hf_to_megatron(state, lay)["decoder.layers.0.self_attention.linear_qkv.weight"]
    assert torch.equal(full, expect)
    rank1 = hf_to_megatron(state, lay, 1, 2)["decoder.layers.0.self_attention.linear_qkv.weight"]
    assert torch.equal(rank1, expect[4 * d :])  # rank 1 holds the whole second group


def test_fc1_shard_is_its_gate_slice_then_its_up_slice() -> None:
    config = _config()
    lay = gpt_layout_from_hf(config)
    state = _random_state(config)
    gate, up = state["model.layers.1.mlp.gate_proj.weight"], state["model.layers.1.mlp.up_proj.weight"]
    rank1 = hf_to_megatron(state, lay, 1, 2)["decoder.layers.1.mlp.linear_fc1.weight"]
    assert torch.equal(rank1, torch.cat([gate[12:], up[12:]]))
    proj = hf_to_megatron(state, lay, 1, 2)["decoder.layers.1.self_attention.linear_proj.weight"]
    assert torch.equal(proj, state["model.layers.1.self_attn.o_proj.weight"][:, 8:])


def test_tensor_parallel_size_must_divide_the_model() -> None:
    lay = gpt_layout_from_hf(_config(num_key_value_heads=1, num_attention_heads=4))
    with pytest.raises(ConfigError, match=r"tensor_parallel=2 .*key/value heads \(1\)"):
        lay.check_tensor_parallel(2)
    lay.check_tensor_parallel(1)


def test_unsupported_models_are_refused_with_the_way_out() -> None:
    with pytest.raises(FeatureUnavailableError, match=r"model type 'gpt2'.*trainer.backend=fsdp2"):
        gpt_layout_from_hf(SimpleNamespace(model_type="gpt2"))
    with pytest.raises(FeatureUnavailableError, match="mlp_bias"):
        gpt_layout_from_hf(_config("llama", mlp_bias=True))
    scaled = _config("llama", rope_scaling={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0})
    with pytest.raises(FeatureUnavailableError, match="RoPE type 'linear'"):
        gpt_layout_from_hf(scaled)
