"""The Megatron-core training backend: a megatron-core GPT model with tensor parallelism.

The policy (and the frozen reference, when a KL penalty needs it) is a megatron-core `GPTModel`
built with the local (Transformer-Engine-free) layer spec from a Hugging Face Qwen2, Llama or
Mistral config; weights are converted from the Hugging Face checkpoint on load and back to
Hugging Face names on export (`megatron_convert`). `trainer.tensor_parallel` ranks split every
attention and MLP weight, the embedding and the output layer; the remaining ranks
(`world_size / tensor_parallel`) are data-parallel replicas whose gradients are summed with one
all-reduce per parameter after the micro-batches. On CPU the ranks talk over gloo and the model
runs through `megatron_shim` (megatron-core 0.16 needs three CUDA-only calls replaced); on CUDA
megatron-core runs unmodified, computing in bf16 under autocast with fp32 master weights. Only the
CPU path has been run.

Micro-batches are padded, not packed: megatron-core's packed-sequence attention needs Transformer
Engine, and its rotary embedding ignores `position_ids`, so sequences are right-padded into rows
of near-equal length (`padded_micro_batches`, at most `micro_batch_tokens` padded tokens each) and
the per-token results are moved back into the packed layout `objective` expects. Logprobs and
entropy are computed from vocabulary-parallel logits a chunk of tokens at a time (recomputed in
the backward pass), so full-vocabulary logits never exist; a token with a kept set
(`Trajectory.kept_sets`) is scored over it, each rank masking its vocabulary shard. The kept-set
disagreement metric needs the whole vocabulary's order and is measured with tensor_parallel=1 only. The optimizer is torch's AdamW on each
rank's shards, with the gradient norm taken over the whole (unsharded) model. The update loop is
`backend.TrainerBackend`'s; this module fills its hooks (micro-batch plan, forward and scoring,
the replicas' gradient all-reduce and the tensor-parallel gradient norm).

Not built here: a critic (GAE needs the FSDP2 backend), LoRA, pipeline/sequence/context
parallelism, megatron's distributed optimizer, and, on CPU, activation recomputation (megatron's
checkpointing saves CUDA RNG state). Checkpoints are per-rank torch files and resume only on the
same tensor-parallel size.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from agentrl.config import AlgorithmConfig, TrainerConfig
from agentrl.errors import ConfigError, FeatureUnavailableError, TrainerError
from agentrl.kept_set import masked_logits, outside_kept_set
from agentrl.sampling import KeptSetRule
from agentrl.trainer.backend import MicroBatches, TrainerBackend
from agentrl.trainer.distributed import balanced_shares, init_distributed, resolve_device
from agentrl.trainer.megatron_convert import (
    gpt_layout_from_hf,
    hf_to_megatron,
    megatron_to_hf,
    partition_dim,
)
from agentrl.trainer.packing import (
    PackedBatch,
    pack_trajectories,
    packed_to_padded,
    padded_to_packed,
    zero_loss_micro_batch,
)
from agentrl.trainer.rng import load_rng, save_rng
from agentrl.types import Trajectory

__all__ = ["MegatronBackend", "padded_micro_batches", "vocab_parallel_scores"]

_CHUNK_ELEMENTS = 1 << 25  # logits per scoring chunk, as in lm_head.ScoringHead


# megatron-core warns on import that Apex and Transformer Engine are missing, and on every
# TransformerConfig about a CUDA-graph default; the backend uses neither, so they are noise here.
_QUIET = r".*(Apex|Transformer Engine|full scope is deprecated).*"


def _megatron() -> Any:
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_QUIET)
            from megatron.core import parallel_state
            from megatron.core.models.gpt import gpt_layer_specs, gpt_model  # noqa: F401
    except ImportError as exc:
        raise FeatureUnavailableError(
            "trainer.backend=megatron needs megatron-core: pip install 'agentrl[megatron]' "
            f"(megatron-core==0.16.*), or use trainer.backend=fsdp2. ({exc})"
        ) from exc
    return parallel_state


def padded_micro_batches(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Group sequences, longest first, into rows of similar length whose padded size (rows x
    longest) stays within `max_tokens`. Returns lists of indices into `lengths`."""
    too_long = [n for n in lengths if n > max_tokens]
    if too_long:
        raise ValueError(
            f"a sequence has {max(too_long)} tokens, more than trainer.micro_batch_tokens={max_tokens}; "
            "raise micro_batch_tokens to at least the longest sequence."
        )
    groups: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        if groups and (len(groups[-1]) + 1) * lengths[groups[-1][0]] <= max_tokens:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def vocab_parallel_scores(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    temperature: float,
    *,
    vocab_start: int,
    with_entropy: bool,
    entropy_grad: bool = True,
    kept_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """(n, 2) per-token (logprob of `labels`, entropy) at `temperature`, from this rank's vocabulary
    shard `weight` (rows `vocab_start` onwards) and the same `hidden` (n, h) on every TP rank.
    With `entropy_grad=False` the entropy is computed without a graph (reported, not a loss term).

    Sums over the vocabulary are all-reduced over the tensor-parallel group with megatron-core's
    mappings (all-reduce forward, identity backward; `hidden` is copied in with the reverse), so
    the result and its gradient are those of the full-vocabulary softmax. With `kept_ids` (n, K)
    (each token's kept set, padded with -1; rows of -1 only have none) every rank sets the logits
    of its shard outside the set to -inf first, so the softmax is the kept set's, renormalised.
    """
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.mappings import (
        copy_to_tensor_model_parallel_region,
        reduce_from_tensor_model_parallel_region,
    )

    group = parallel_state.get_tensor_model_parallel_group()

    def reduce(t: torch.Tensor) -> torch.Tensor:
        reduced: torch.Tensor = reduce_from_tensor_model_parallel_region(t, group=group)
        return reduced

    x = copy_to_tensor_model_parallel_region(hidden, group=group)
    z = F.linear(x, weight).float() / temperature
    if kept_ids is not None:
        z = masked_logits(z, kept_ids, vocab_start=vocab_start)
    top = z.detach().max(-1).values
    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
    shifted = z - top[:, None]
    kept = torch.isfinite(shifted)  # all True without kept sets
    exp = shifted.exp()
    sum_exp = reduce(exp.sum(-1))
    local = labels.long() - vocab_start
    inside = (local >= 0) & (local < z.shape[-1])
    picked = shifted.gather(-1, local.clamp(0, z.shape[-1] - 1)[:, None])[:, 0]
    target = torch.where(inside, picked, torch.zeros_like(picked))
    target = reduce(target)
    log_z = sum_exp.log()
    logprob = target - log_z
    if not with_entropy:
        return torch.stack([logprob, torch.zeros_like(logprob)], dim=-1)
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        finite = shifted.masked_fill(~kept, 0.0)  # tokens outside a kept set add 0, and no NaN gradient
        e, s, total = (exp, finite, sum_exp) if entropy_grad else (exp.detach(), finite.detach(), sum_exp.detach())
        entropy = total.log() - reduce((e * s).sum(-1)) / total
    return torch.stack([logprob, entropy], dim=-1)


@contextlib.contextmanager
def _hidden_states_only(model: Any) -> Iterator[None]:
    # GPTModel returns the final (normed) hidden states instead of logits when it is not the
    # post-processing stage; the output layer is applied by `vocab_parallel_scores` in chunks.
    model.post_process = False
    try:
        yield
    finally:
        model.post_process = True


class MegatronBackend(TrainerBackend):
    """A megatron-core GPT policy (and optionally a frozen reference) with tensor parallelism.

    Arguments mirror `FSDP2Backend`: `trainer` gives the optimisation settings and
    `tensor_parallel`; `with_reference` defaults to what `algorithm` needs (kl_coef > 0); `dtype`
    is `ModelConfig.dtype` (`auto`: bf16 autocast on CUDA, fp32 on CPU); `deterministic` turns on
    torch's deterministic algorithms.
    """

    scores_in_update = True

    def __init__(
        self,
        model_path: str | Path,
        trainer: TrainerConfig,
        algorithm: AlgorithmConfig | None = None,
        *,
        with_reference: bool | None = None,
        with_critic: bool | None = None,
        dtype: str = "auto",
        seed: int = 0,
        deterministic: bool = False,
        trust_remote_code: bool = False,
    ) -> None:
        ps = _megatron()
        if with_critic is None:
            with_critic = bool(algorithm is not None and algorithm.advantage == "gae")
        unsupported = []
        if with_critic:
            unsupported.append("a critic (algorithm.advantage=gae)")
        if trainer.lora_rank > 0:
            unsupported.append(f"LoRA (trainer.lora_rank={trainer.lora_rank})")
        self.device = resolve_device(trainer.device)
        if trainer.gradient_checkpointing and self.device.type == "cpu":
            unsupported.append("gradient checkpointing on CPU")
        if dtype == "float16":
            unsupported.append("float16 (needs a loss scaler; use bfloat16)")
        if unsupported:
            raise FeatureUnavailableError(
                f"the Megatron backend does not support {', '.join(unsupported)}; "
                "use trainer.backend=fsdp2 for these."
            )
        self.config = trainer
        self.model_path = str(model_path)
        self.rank, self.world_size = init_distributed(self.device)
        tp = trainer.tensor_parallel
        if self.world_size % tp:
            raise ConfigError(
                f"trainer.tensor_parallel={tp} does not divide the {self.world_size} trainer processes; "
                "set trainer.num_processes to a multiple of it."
            )
        if not ps.model_parallel_is_initialized():
            ps.initialize_model_parallel(
                tensor_model_parallel_size=tp, create_gloo_process_groups=self.device.type == "cuda"
            )
        elif ps.get_tensor_model_parallel_world_size() != tp:
            raise ConfigError(
                f"megatron-core is already set up with tensor parallel size "
                f"{ps.get_tensor_model_parallel_world_size()}, not trainer.tensor_parallel={tp}; one "
                "process holds one layout."
            )
        self.tp, self.tp_rank = tp, ps.get_tensor_model_parallel_rank()
        self.dp, self.dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
        self._tp_group, self._dp_group = ps.get_tensor_model_parallel_group(), ps.get_data_parallel_group()
        if self.device.type == "cpu":
            from agentrl.trainer.megatron_shim import apply_cpu_shim, cpu_manual_seed

            apply_cpu_shim()
            cpu_manual_seed(seed, self.tp_rank)
        else:
            from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

            torch.manual_seed(seed)
            model_parallel_cuda_manual_seed(seed)
        if deterministic:
            torch.use_deterministic_algorithms(True)
        if dtype not in ("auto", "float32", "bfloat16"):
            raise ConfigError(f"model.dtype '{dtype}' is not one of auto, float32, bfloat16.")
        bf16 = dtype == "bfloat16" or (dtype == "auto" and self.device.type == "cuda")
        self._autocast = torch.bfloat16 if bf16 else None

        from transformers import AutoConfig, AutoModelForCausalLM

        remote = {"trust_remote_code": trust_remote_code}
        self.layout = gpt_layout_from_hf(AutoConfig.from_pretrained(self.model_path, **remote))
        self.layout.check_tensor_parallel(tp)
        hf = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=torch.float32, **remote)
        hf_state = hf.state_dict()
        del hf
        if with_reference is None:
            with_reference = bool(algorithm is not None and algorithm.kl_coef > 0)
        self.policy = self._build_model(hf_state, trainable=True)
        self.reference = self._build_model(hf_state, trainable=False) if with_reference else None
        del hf_state
        self.optimizer, self.scheduler = self._optimizer(self.policy.parameters(), trainer.lr)
        self._step = 0

    # ── building ────────────────────────────────────────────────────────────────────────────
    def _transformer_config(self) -> Any:
        from megatron.core.transformer.transformer_config import TransformerConfig

        lay = self.layout
        recompute: dict[str, Any] = {}
        if self.config.gradient_checkpointing:
            recompute = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_QUIET)
            return TransformerConfig(
                num_layers=lay.num_layers, hidden_size=lay.hidden_size, ffn_hidden_size=lay.ffn_hidden_size,
                num_attention_heads=lay.num_attention_heads, num_query_groups=lay.num_query_groups,
                kv_channels=lay.head_dim, normalization="RMSNorm", layernorm_epsilon=lay.norm_eps,
                gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False, add_qkv_bias=lay.qkv_bias,
                hidden_dropout=0.0, attention_dropout=0.0, tensor_model_parallel_size=self.tp,
                params_dtype=torch.float32, use_cpu_initialization=True,
                perform_initialization=False,  # every weight comes from the checkpoint
                bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
                apply_rope_fusion=False, persist_layer_norm=False, gradient_accumulation_fusion=False,
                **recompute,
            )  # fmt: skip

    def _build_model(self, hf_state: dict[str, torch.Tensor], *, trainable: bool) -> nn.Module:
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

        lay = self.layout
        model: nn.Module = GPTModel(
            self._transformer_config(),
            get_gpt_layer_local_spec(normalization="RMSNorm"),
            vocab_size=lay.vocab_size,
            max_sequence_length=lay.max_position_embeddings,
            share_embeddings_and_output_weights=lay.tied_embeddings,
            position_embedding_type="rope",
            rotary_base=lay.rope_theta,
        )
        model.load_state_dict(hf_to_megatron(hf_state, lay, self.tp_rank, self.tp), strict=True)
        model.to(self.device)
        if not trainable:
            model.requires_grad_(False)
            model.eval()
        return model

    # ── hooks of the update loop (`TrainerBackend`) ─────────────────────────────────────────
    def _all_reduce(self, tensor: torch.Tensor, op: str) -> None:
        # TP ranks of one replica hold identical results: combine across replicas only.
        if self.dp > 1:
            dist.all_reduce(
                tensor, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM, group=self._dp_group
            )

    def _micro_batches(
        self, trajectories: Sequence[Trajectory], rows: Sequence[int] | None = None, *, at_least_one: bool = False
    ) -> MicroBatches:
        # This replica's share, packed for the bookkeeping and run padded. The replicas meet only
        # in the gradient all-reduce, so none pads its list to another's.
        order = list(range(len(trajectories))) if rows is None else list(rows)
        trajectories = [trajectories[i] for i in order]
        lengths = [len(t.token_ids) for t in trajectories]
        mine = balanced_shares(lengths, self.dp)[self.dp_rank]
        plan = []
        for members in padded_micro_batches([lengths[i] for i in mine], self.config.micro_batch_tokens):
            idx = sorted(mine[j] for j in members)
            batch = pack_trajectories([trajectories[i] for i in idx])
            batch.indices = [order[i] for i in idx]
            plan.append((batch, True))
        if at_least_one and not plan:
            plan.append((zero_loss_micro_batch(), False))
        return plan

    def _token_scores(
        self, model: nn.Module, batch: PackedBatch, temperature: float, *, with_entropy: bool,
        entropy_grad: bool = True, kept_rule: KeptSetRule | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        # The kept-set disagreement needs the full vocabulary's order on one rank: it is measured
        # with tensor_parallel=1 only (with more, `onpolicy/kept_set_disagreement` is not reported).
        # Run as right-padded rows; the per-token results go back into the packed layout.
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0 to score tokens, got {temperature}.")
        input_ids = packed_to_padded(batch.input_ids, batch.cu_seqlens).to(self.device)
        labels = packed_to_padded(batch.labels, batch.cu_seqlens).to(self.device)
        rows, width = input_ids.shape
        positions = torch.arange(width, device=self.device).expand(rows, width)
        causal = torch.ones((width, width), dtype=torch.bool, device=self.device).triu(1)[None, None]
        autocast = (
            torch.autocast(self.device.type, dtype=self._autocast)
            if self._autocast is not None
            else contextlib.nullcontext()
        )
        with autocast, _hidden_states_only(model):
            hidden = model(input_ids, positions, causal)  # (width, rows, h)
        hidden = hidden.transpose(0, 1).reshape(rows * width, -1)
        flat_labels = labels.reshape(-1)
        flat_kept = None
        if batch.kept_ids is not None:
            padded = packed_to_padded(batch.kept_ids, batch.cu_seqlens, fill=-1)
            flat_kept = padded.reshape(rows * width, -1).to(self.device, torch.long)
        gpt: Any = model  # a megatron-core GPTModel (untyped)
        weight = gpt.shared_embedding_or_output_weight() if self.layout.tied_embeddings else None
        if weight is None:
            weight = gpt.output_layer.weight
        vocab_start = self.tp_rank * weight.shape[0]
        chunk = max(16, _CHUNK_ELEMENTS // weight.shape[0])
        outs = []
        for start in range(0, hidden.shape[0], chunk):
            args = (hidden[start : start + chunk], weight, flat_labels[start : start + chunk], temperature)
            kwargs: dict[str, Any] = {
                "vocab_start": vocab_start, "with_entropy": with_entropy, "entropy_grad": entropy_grad,
                "kept_ids": flat_kept[start : start + chunk] if flat_kept is not None else None,
            }
            # Every chunk but the last is recomputed in the backward (see lm_head.ScoringHead).
            if torch.is_grad_enabled() and hidden.requires_grad and start + chunk < hidden.shape[0]:
                outs.append(checkpoint(vocab_parallel_scores, *args, use_reentrant=False, **kwargs))
            else:
                outs.append(vocab_parallel_scores(*args, **kwargs))
        scores = padded_to_packed(torch.cat(outs).reshape(rows, width, 2), batch.cu_seqlens)
        if kept_rule is not None and kept_rule.truncates and self.tp == 1:
            with torch.no_grad():  # a chunk at a time, as the scores
                outside = torch.cat([
                    outside_kept_set(F.linear(hidden[a : a + chunk].detach(), weight.detach()).float() / temperature,
                                     flat_labels[a : a + chunk], kept_rule)
                    for a in range(0, hidden.shape[0], chunk)
                ]).reshape(rows, width)
            self._count_disagreement(padded_to_packed(outside, batch.cu_seqlens).to(batch.loss_mask.device),
                                     batch.loss_mask > 0)
        return scores[..., 0], (scores[..., 1] if with_entropy else None)

    def _grad_norm(self, model: nn.Module) -> torch.Tensor:
        # The loss is normalised by the global count: sum the replicas' gradients. In the norm,
        # sharded parameters are summed over TP ranks and replicated ones (identical on every TP
        # rank) counted once. Which is which comes from the parameter's name: megatron-core marks
        # its weights `tensor_model_parallel` only when it initialises them, which we skip.
        grads = [(n, g) for n, p in model.named_parameters() if (g := p.grad) is not None]
        if self.dp > 1:
            for _, grad in grads:
                dist.all_reduce(grad, group=self._dp_group)
        sharded = torch.zeros((), dtype=torch.float64, device=self.device)
        replicated = torch.zeros((), dtype=torch.float64, device=self.device)
        for name, grad in grads:
            sq = grad.detach().double().pow(2).sum()
            if partition_dim(name) is not None:
                sharded += sq
            else:
                replicated += sq
        if self.tp > 1:
            dist.all_reduce(sharded, group=self._tp_group)
        return (sharded + replicated).sqrt().float()

    # ── weights and checkpoints ─────────────────────────────────────────────────────────────
    def _shards(self, name: str, tensor: torch.Tensor) -> list[torch.Tensor]:
        tensor = tensor.detach().contiguous()
        if partition_dim(name) is None or self.tp == 1:
            return [tensor.cpu()]
        shards = [torch.empty_like(tensor) for _ in range(self.tp)]
        dist.all_gather(shards, tensor, group=self._tp_group)
        return [s.cpu() for s in shards]

    def export_weights(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """The policy under Hugging Face names, gathered over the tensor-parallel ranks."""
        for name, param in self.policy.named_parameters():
            for hf_name, full in megatron_to_hf(name, self._shards(name, param), self.layout):
                yield hf_name, full.to(dtype) if dtype is not None else full

    def save(self, path: str | Path, data_position: dict[str, Any] | None = None) -> None:
        from megatron.core.tensor_parallel import get_cuda_rng_tracker

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        if self.dp_rank == 0:  # one copy of each TP shard
            shard = {"policy": self.policy.state_dict(), "optimizer": self.optimizer.state_dict()}
            torch.save(shard, path / f"model_tp{self.tp_rank}.pt")
        save_rng(path, self.rank, megatron={k: v.clone() for k, v in get_cuda_rng_tracker().get_states().items()})
        self._write_state(path, data_position, tensor_parallel=self.tp)
        dist.barrier()

    def load(self, path: str | Path) -> dict[str, Any]:
        from megatron.core.tensor_parallel import get_cuda_rng_tracker

        path = Path(path)
        meta = self._read_state(path)
        if meta["tensor_parallel"] != self.tp:
            raise TrainerError(
                f"the checkpoint at '{path}' was saved with tensor_parallel={meta['tensor_parallel']}; "
                f"resume with trainer.tensor_parallel={meta['tensor_parallel']} (this run has {self.tp})."
            )
        shard = torch.load(path / f"model_tp{self.tp_rank}.pt", weights_only=True)
        self.policy.load_state_dict(shard["policy"])
        self.optimizer.load_state_dict(shard["optimizer"])
        self.scheduler.load_state_dict(meta["scheduler"])
        self._step = int(meta["global_step"])
        get_cuda_rng_tracker().set_states(dict(load_rng(path, self.rank)["megatron"]))
        return dict(meta["data_position"])
