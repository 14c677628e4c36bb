"""Hugging Face Qwen2/Llama checkpoints to megatron-core GPT models and back, tensor-parallel aware.

`gpt_layout_from_hf` reads a Hugging Face config into a `GPTLayout` (the handful of numbers and
switches the model needs) and refuses what the local megatron-core spec cannot express (QK norms,
biases outside q/k/v, sliding windows, scaled RoPE). `hf_to_megatron` cuts a full Hugging Face
state dict into the tensors of one tensor-parallel rank; `megatron_to_hf` joins the shards of
every rank back into Hugging Face tensors. The two are exact inverses (pure reshapes and slices).

Layouts, megatron-core 0.16 with the local (non-Transformer-Engine) spec:

- `linear_qkv` holds, for each key/value group in order, that group's query heads, then its key
  head, then its value head; a rank holds a contiguous run of whole groups.
- `linear_fc1` holds `[gate; up]` *per rank*: rank r's shard is its slice of the gate projection
  followed by its slice of the up projection, so the concatenated shards interleave.
- Column-parallel weights (qkv, fc1, the embedding and the output layer) are split along dim 0,
  row-parallel ones (`linear_proj`, `linear_fc2`) along dim 1; norms are replicated.

This module holds no model and no process group; `megatron.MegatronBackend` builds and gathers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from agentrl.errors import ConfigError, FeatureUnavailableError

__all__ = [
    "GPTLayout",
    "convert_all_to_hf",
    "gpt_layout_from_hf",
    "hf_to_megatron",
    "megatron_to_hf",
    "partition_dim",
]

_SUPPORTED = ("qwen2", "llama", "mistral")


@dataclass(frozen=True)
class GPTLayout:
    """What a megatron-core GPT model needs to match a Hugging Face decoder."""

    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    rope_theta: float
    norm_eps: float
    qkv_bias: bool
    tied_embeddings: bool

    def check_tensor_parallel(self, tp: int) -> None:
        """Raise ConfigError unless heads, groups, the FFN and the vocabulary split over `tp` ranks."""
        problems = []
        for what, n in (
            ("attention heads", self.num_attention_heads),
            ("key/value heads", self.num_query_groups),
            ("intermediate size", self.ffn_hidden_size),
            ("vocabulary", self.vocab_size),
        ):
            if n % tp:
                problems.append(f"{what} ({n})")
        if problems:
            raise ConfigError(
                f"trainer.tensor_parallel={tp} does not divide the model's {', '.join(problems)}; "
                "pick a tensor-parallel size that divides them."
            )


def _rope_theta(config: Any) -> float:
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in (None, "default"):
        raise FeatureUnavailableError(
            f"RoPE type '{kind}' is not supported by the Megatron backend (only unscaled RoPE); "
            "use trainer.backend=fsdp2 for this model."
        )
    theta = params.get("rope_theta", getattr(config, "rope_theta", None))
    if theta is None:
        raise ConfigError("the model config names no rope_theta; cannot build its rotary embedding.")
    return float(theta)


def gpt_layout_from_hf(config: Any) -> GPTLayout:
    """The `GPTLayout` of a Hugging Face `PretrainedConfig` (Qwen2, Llama or Mistral)."""
    kind = getattr(config, "model_type", None)
    if kind not in _SUPPORTED:
        raise FeatureUnavailableError(
            f"model type '{kind}' is not supported by the Megatron backend (supported: "
            f"{', '.join(_SUPPORTED)}); use trainer.backend=fsdp2."
        )
    unsupported = []
    if getattr(config, "hidden_act", "silu") != "silu":
        unsupported.append(f"hidden_act={config.hidden_act}")
    if getattr(config, "mlp_bias", False):
        unsupported.append("mlp_bias")
    if kind != "qwen2" and getattr(config, "attention_bias", False):
        unsupported.append("attention_bias (o_proj bias)")
    if getattr(config, "use_sliding_window", False) or (kind == "mistral" and config.sliding_window):
        unsupported.append("sliding-window attention")
    if unsupported:
        raise FeatureUnavailableError(
            f"the Megatron backend cannot express {', '.join(unsupported)} of this {kind} model; "
            "use trainer.backend=fsdp2."
        )
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return GPTLayout(
        num_layers=config.num_hidden_layers,
        hidden_size=config.hidden_size,
        ffn_hidden_size=config.intermediate_size,
        num_attention_heads=heads,
        num_query_groups=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=head_dim,
        vocab_size=config.vocab_size,
        max_position_embeddings=config.max_position_embeddings,
        rope_theta=_rope_theta(config),
        norm_eps=config.rms_norm_eps,
        qkv_bias=kind == "qwen2" or bool(getattr(config, "attention_bias", False)),
        tied_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
    )


def partition_dim(megatron_name: str) -> int | None:
    """The dimension a megatron parameter is split along across TP ranks (None: replicated)."""
    if megatron_name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return 1
    if (
        megatron_name.endswith(
            ("linear_qkv.weight", "linear_qkv.bias", "linear_fc1.weight", "word_embeddings.weight")
        )
        or megatron_name == "output_layer.weight"
    ):
        return 0
    return None


# ── per-layer pieces ───────────────────────────────────────────────────────────────────────────
def _qkv_to_megatron(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lay: GPTLayout) -> torch.Tensor:
    g, d = lay.num_query_groups, lay.head_dim
    per = lay.num_attention_heads // g
    rest = q.shape[1:]
    parts = (q.reshape(g, per * d, *rest), k.reshape(g, d, *rest), v.reshape(g, d, *rest))
    return torch.cat(parts, dim=1).reshape(g * (per + 2) * d, *rest)


def _qkv_to_hf(qkv: torch.Tensor, lay: GPTLayout) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g, d = lay.num_query_groups, lay.head_dim
    per = lay.num_attention_heads // g
    rest = qkv.shape[1:]
    grouped = qkv.reshape(g, (per + 2) * d, *rest)
    q, k, v = torch.split(grouped, [per * d, d, d], dim=1)
    return (
        q.reshape(g * per * d, *rest).clone(),
        k.reshape(g * d, *rest).clone(),
        v.reshape(g * d, *rest).clone(),
    )


def _layer_map(i: int) -> dict[str, str]:
    """Megatron names of layer i's one-to-one tensors -> Hugging Face names."""
    m, h = f"decoder.layers.{i}.", f"model.layers.{i}."
    return {
        m + "input_layernorm.weight": h + "input_layernorm.weight",
        m + "pre_mlp_layernorm.weight": h + "post_attention_layernorm.weight",
        m + "self_attention.linear_proj.weight": h + "self_attn.o_proj.weight",
        m + "mlp.linear_fc2.weight": h + "mlp.down_proj.weight",
    }


def _global_map(lay: GPTLayout) -> dict[str, str]:
    out = {
        "embedding.word_embeddings.weight": "model.embed_tokens.weight",
        "decoder.final_layernorm.weight": "model.norm.weight",
    }
    if not lay.tied_embeddings:
        out["output_layer.weight"] = "lm_head.weight"
    return out


def _shard(tensor: torch.Tensor, dim: int | None, rank: int, tp: int) -> torch.Tensor:
    if dim is None or tp == 1:
        return tensor.clone()
    return torch.chunk(tensor, tp, dim=dim)[rank].clone()


# ── the two directions ─────────────────────────────────────────────────────────────────────────
def hf_to_megatron(
    hf_state: Mapping[str, torch.Tensor], lay: GPTLayout, tp_rank: int = 0, tp_size: int = 1
) -> dict[str, torch.Tensor]:
    """Rank `tp_rank`'s megatron-core state dict (of `tp_size`) from a full Hugging Face state dict."""
    lay.check_tensor_parallel(tp_size)

    def get(name: str) -> torch.Tensor:
        if name not in hf_state:
            raise ConfigError(
                f"the Hugging Face checkpoint has no tensor '{name}'; is it a {_SUPPORTED} model?"
            )
        return hf_state[name]

    out: dict[str, torch.Tensor] = {}
    simple = dict(_global_map(lay))
    for i in range(lay.num_layers):
        simple.update(_layer_map(i))
        m, h = f"decoder.layers.{i}.", f"model.layers.{i}.self_attn."
        qkv = _qkv_to_megatron(
            get(h + "q_proj.weight"), get(h + "k_proj.weight"), get(h + "v_proj.weight"), lay
        )
        out[m + "self_attention.linear_qkv.weight"] = _shard(qkv, 0, tp_rank, tp_size)
        if lay.qkv_bias:
            bias = _qkv_to_megatron(
                get(h + "q_proj.bias"), get(h + "k_proj.bias"), get(h + "v_proj.bias"), lay
            )
            out[m + "self_attention.linear_qkv.bias"] = _shard(bias, 0, tp_rank, tp_size)
        mlp = f"model.layers.{i}.mlp."
        gate = _shard(get(mlp + "gate_proj.weight"), 0, tp_rank, tp_size)
        up = _shard(get(mlp + "up_proj.weight"), 0, tp_rank, tp_size)
        out[m + "mlp.linear_fc1.weight"] = torch.cat([gate, up])
    for mname, hname in simple.items():
        out[mname] = _shard(get(hname), partition_dim(mname), tp_rank, tp_size)
    return out


def megatron_to_hf(
    name: str, shards: Sequence[torch.Tensor], lay: GPTLayout
) -> Iterator[tuple[str, torch.Tensor]]:
    """The Hugging Face tensors one megatron parameter stands for, from its shards on every TP rank
    (in rank order; one shard for a replicated parameter)."""
    dim = partition_dim(name)
    if name.endswith("linear_fc1.weight"):
        halves = [torch.chunk(s, 2, dim=0) for s in shards]
        prefix = name.removeprefix("decoder.").replace("mlp.linear_fc1.weight", "mlp.")
        yield "model." + prefix + "gate_proj.weight", torch.cat([g for g, _ in halves])
        yield "model." + prefix + "up_proj.weight", torch.cat([u for _, u in halves])
        return
    full = torch.cat(list(shards), dim=dim) if dim is not None and len(shards) > 1 else shards[0].clone()
    if ".self_attention.linear_qkv." in name:
        kind = name.rsplit(".", 1)[1]
        prefix = "model." + name.removeprefix("decoder.").split(".self_attention.")[0] + ".self_attn."
        for proj, t in zip("qkv", _qkv_to_hf(full, lay), strict=True):
            yield f"{prefix}{proj}_proj.{kind}", t
        return
    layer = name.split(".")[2] if name.startswith("decoder.layers.") else None
    table = _layer_map(int(layer)) if layer is not None else _global_map(lay)
    if name not in table:
        raise KeyError(f"no Hugging Face name for megatron parameter '{name}'.")
    yield table[name], full
    if lay.tied_embeddings and name == "embedding.word_embeddings.weight":
        yield "lm_head.weight", full  # as a tied Hugging Face model's state_dict lists it


def convert_all_to_hf(
    names: Sequence[str], shards_of: Callable[[str], Sequence[torch.Tensor]], lay: GPTLayout
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every Hugging Face tensor of a model whose megatron parameters are `names`; `shards_of(name)`
    returns that parameter's shards. With tied embeddings `lm_head.weight` is emitted as the
    embedding tensor, as a tied Hugging Face model's `state_dict()` lists it."""
    for name in names:
        yield from megatron_to_hf(name, shards_of(name), lay)
