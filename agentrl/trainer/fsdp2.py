"""The FSDP2 training backend: Hugging Face models sharded with `torch.distributed.fsdp.fully_shard`.

Every decoder layer (the model's `_no_split_modules` classes) and then the root are wrapped with
`fully_shard`, so each rank holds 1/N of every parameter, gradient and AdamW state, and gathers a
layer's full weights only while it runs. It runs on CPU with gloo and on CUDA with NCCL, where
parameters are computed in bf16 and gradients reduced in fp32 (`MixedPrecisionPolicy`); on CPU
everything is fp32. Only the CPU path is tested here; the CUDA path is written but has not been run.

One process still creates a one-rank group and runs the same planning, scoring and checkpoint
code, but an fp32 model on one rank is not wrapped with `fully_shard`: with nothing to shard, FSDP2
only copies every layer in and out of its all-gather and reduce-scatter buffers. On SmolLM2-135M
(32 trajectories, 512-token micro-batches, CPU) skipping it cut a `train_step`'s peak RSS from 5.7
to 3.9 GB and its time from 22.9 to 20.9 s. Checkpoints are DCP either way, so a run saved on N
ranks resumes on one and back. With a low-precision compute dtype one rank is still wrapped, for
the `MixedPrecisionPolicy`.

Work is split across ranks by tokens (`distributed.balanced_shares`) and within a rank into packed
token-budget micro-batches; ranks with fewer micro-batches run empty ones, because every forward
and backward of an FSDP model is a collective. The LM head is swapped for `lm_head.ScoringHead`,
which scores labels in chunks so full-vocabulary logits never exist for a whole micro-batch.
Optional parts: a critic (the policy's backbone plus a scalar value head) for GAE, a frozen
reference policy for a KL penalty, gradient checkpointing, and LoRA on the policy (peft adapters on
the frozen model, `trainer.lora_*`; the critic is always fully trained; exported weights have the
adapters merged, so servers load a plain checkpoint). Checkpoints use
torch.distributed.checkpoint (DCP) for the sharded models and optimizers, plus the LR schedules,
global step, data position (rank 0) and the RNG states of every rank. Every rank loads the full
Hugging Face checkpoint before sharding it: fine for small models, wasteful for large ones (meta
device initialisation with a rank-0 broadcast is not built).

The update loop (mini-batches, gradient accumulation, zero-loss rows, clipping, the optimizer
step) is `backend.TrainerBackend`'s; this module fills its hooks: the micro-batch plan above, the
forward through the chunked head, the backward scaled for FSDP's gradient average, the norm of the
sharded gradient. It is not the RL algorithm (see `step.train_step`) nor the loss maths (`objective`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from agentrl.config import AlgorithmConfig, TrainerConfig
from agentrl.errors import ConfigError, FeatureUnavailableError, TrainerError
from agentrl.kept_set import entropy_of, masked_logits, outside_kept_set
from agentrl.sampling import KeptSetRule
from agentrl.trainer.backend import MicroBatches, TrainerBackend
from agentrl.trainer.distributed import balanced_shares, init_distributed, resolve_device
from agentrl.trainer.lm_head import ScoringHead, install_scoring_head, scoring
from agentrl.trainer.packing import (
    PackedBatch,
    compute_entropy,
    compute_token_logprobs,
    pack_trajectories,
    prefix_units,
    split_micro_batches,
    zero_loss_micro_batch,
)
from agentrl.trainer.rng import load_rng, save_rng
from agentrl.types import Trajectory

__all__ = ["FSDP2Backend", "ValueModel"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ValueModel(nn.Module):
    """A critic: a transformer backbone and a linear head giving one value per token."""

    def __init__(self, backbone: nn.Module, hidden_size: int) -> None:
        super().__init__()
        self.backbone = backbone
        self.value_head = nn.Linear(hidden_size, 1)
        nn.init.normal_(self.value_head.weight, std=1.0 / (hidden_size + 1))
        nn.init.zeros_(self.value_head.bias)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        use_cache: bool = False,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        hidden = self.backbone(
            input_ids=input_ids, position_ids=position_ids, use_cache=use_cache, attention_mask=attention_mask
        )
        # A fresh tensor, not a squeeze view: FSDP2 hooks its backward on the module's output.
        values: torch.Tensor = self.value_head(hidden.last_hidden_state).float().sum(-1)
        return values


class FSDP2Backend(TrainerBackend):
    """A policy, and optionally a critic and a frozen reference, sharded with FSDP2.

    `trainer` gives the optimisation settings (lr, warm-up, clipping, micro-batch budget,
    gradient checkpointing, device). `with_reference` / `with_critic` default to what `algorithm`
    needs (kl_coef > 0; advantage `gae`). `dtype` is `ModelConfig.dtype` (`auto`: bf16 compute on
    CUDA, fp32 on CPU); master weights and optimizer state are always fp32. `deterministic` turns
    on torch's deterministic algorithms (for exact resume tests).
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
        chunked_head: bool = True,
        trust_remote_code: bool = False,
    ) -> None:
        if trainer.lora_rank > 0:
            try:
                import peft  # noqa: F401
            except ImportError as exc:
                raise FeatureUnavailableError(
                    f"trainer.lora_rank={trainer.lora_rank} needs peft: pip install 'agentrl[lora]', "
                    "or set trainer.lora_rank=0 for full fine-tuning."
                ) from exc
        self.config = trainer
        self._chunked_head = chunked_head
        # Score only the tokens the loss uses (prompt and tool tokens read 0): in multi-turn RL
        # they are most of the sequence, and the LM head dominates a small model's cost.
        self.score_all_tokens = False
        self._heads: dict[int, ScoringHead | None] = {}
        self.model_path = str(model_path)
        self.trust_remote_code = trust_remote_code
        self.device = resolve_device(trainer.device)
        self.rank, self.world_size = init_distributed(self.device)
        self.mesh = init_device_mesh(self.device.type, (self.world_size,))
        if deterministic:
            torch.use_deterministic_algorithms(True)
        if dtype != "auto" and dtype not in _DTYPES:
            raise ConfigError(f"model.dtype '{dtype}' is not one of auto, {', '.join(_DTYPES)}.")
        compute = (
            _DTYPES[dtype]
            if dtype != "auto"
            else (torch.bfloat16 if self.device.type == "cuda" else torch.float32)
        )
        if compute is torch.float16:
            raise FeatureUnavailableError(
                "float16 training needs a loss scaler, which is not built; use bfloat16."
            )
        # Params are gathered in the compute dtype; gradients are reduced and kept in fp32.
        self._mp = (
            MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32)
            if compute != torch.float32
            else None
        )
        if with_reference is None:
            with_reference = bool(algorithm is not None and algorithm.kl_coef > 0)
        if with_critic is None:
            with_critic = bool(algorithm is not None and algorithm.advantage == "gae")

        torch.manual_seed(seed)  # every rank initialises new weights (the value head) alike
        self.policy = self._build_policy(trainable=True)
        # Shared prefixes need an explicit boolean mask, which only the sdpa path takes as is.
        attention = getattr(getattr(self.policy, "config", None), "_attn_implementation", None)
        self.share_prefixes = trainer.share_prefixes and attention == "sdpa"
        self.optimizer, self.scheduler = self._optimizer(
            [p for p in self.policy.parameters() if p.requires_grad], trainer.lr
        )
        self.reference = self._build_policy(trainable=False) if with_reference else None
        if with_critic:
            self.critic = self._build_critic()
            self.critic_optimizer, self.critic_scheduler = self._optimizer(self.critic.parameters(), trainer.critic_lr)
        self._step = 0

    # ── building ────────────────────────────────────────────────────────────────────────────
    def _shard(self, model: nn.Module, layer_classes: Sequence[str]) -> nn.Module:
        if self.world_size == 1 and self._mp is None:
            return model.to(self.device)  # nothing to shard (module docstring)
        kwargs: dict[str, Any] = {"mesh": self.mesh}
        if self._mp is not None:
            kwargs["mp_policy"] = self._mp
        layers = [m for m in model.modules() if type(m).__name__ in set(layer_classes)]
        if not layers:
            raise TrainerError(
                f"found no decoder layers of classes {list(layer_classes)} in {type(model).__name__}; "
                "the model must declare _no_split_modules."
            )
        for layer in layers:
            fully_shard(layer, **kwargs)
        fully_shard(model, **kwargs)
        return model

    def _build_policy(self, *, trainable: bool) -> nn.Module:
        from transformers import AutoModelForCausalLM

        model: Any = AutoModelForCausalLM.from_pretrained(
            self.model_path, dtype=torch.float32, trust_remote_code=self.trust_remote_code
        )
        if trainable and self.config.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if not trainable:
            model.requires_grad_(False)
            model.eval()
        head = install_scoring_head(model) if self._chunked_head else None
        layer_classes = list(model._no_split_modules or [])
        if trainable and self.config.lora_rank > 0:
            model = self._add_lora(model)
        self._heads[id(model)] = head
        return self._shard(model, layer_classes)

    def _add_lora(self, model: Any) -> nn.Module:
        """Freeze the model and wrap it with peft LoRA adapters (`trainer.lora_*`)."""
        from peft import LoraConfig, get_peft_model

        targets = self.config.lora_target_modules
        lora = LoraConfig(
            r=self.config.lora_rank,
            lora_alpha=self.config.lora_alpha,
            lora_dropout=0.0,
            target_modules=targets[0] if targets == ["all-linear"] else list(targets),
            bias="none",
        )
        if self.config.gradient_checkpointing:
            model.enable_input_require_grads()  # checkpointed layers need a grad-requiring input
        return get_peft_model(model, lora)

    def _build_critic(self) -> nn.Module:
        from transformers import AutoModel

        backbone = AutoModel.from_pretrained(
            self.model_path, dtype=torch.float32, trust_remote_code=self.trust_remote_code
        )
        if self.config.gradient_checkpointing:
            backbone.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        critic = ValueModel(backbone, backbone.config.hidden_size)
        return self._shard(critic, backbone._no_split_modules or [])

    # ── hooks of the update loop (`TrainerBackend`) ─────────────────────────────────────────
    def _all_reduce(self, tensor: torch.Tensor, op: str) -> None:
        if self.world_size > 1:
            dist.all_reduce(tensor, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)

    def _micro_batches(
        self, trajectories: Sequence[Trajectory], rows: Sequence[int] | None = None, *, at_least_one: bool = False
    ) -> MicroBatches:
        # Every forward and backward of a sharded model is a collective: pad each rank's list with
        # empty micro-batches to the count of the busiest rank.
        order = list(range(len(trajectories))) if rows is None else list(rows)
        trajectories = [trajectories[i] for i in order]
        budget = self.config.micro_batch_tokens
        if self.share_prefixes:
            # Samples of a group stay together so their prompt is packed once (`prefix_units`).
            units = prefix_units(trajectories, budget, min_units=self.world_size)
        else:
            units = [([i], len(t.token_ids)) for i, t in enumerate(trajectories)]
        mine = [units[u] for u in balanced_shares([c for _, c in units], self.world_size)[self.rank]]
        plan = []
        for members in split_micro_batches([c for _, c in mine], budget):
            idx = sorted(i for j in members for i in mine[j][0])
            batch = pack_trajectories(
                [trajectories[i] for i in idx], device=self.device, share_prefixes=self.share_prefixes
            )
            batch.indices = [order[i] for i in idx]
            plan.append((batch, True))
        count = torch.tensor([max(len(plan), int(at_least_one))], dtype=torch.float64)
        self._all_reduce(count, "max")
        if len(plan) < int(count.item()):
            plan += [(zero_loss_micro_batch(self.device), False)] * (int(count.item()) - len(plan))
        return plan

    def _values(self, model: nn.Module, batch: PackedBatch) -> torch.Tensor:
        values: torch.Tensor = model(**batch.model_inputs())
        return values

    def _token_scores(
        self, model: nn.Module, batch: PackedBatch, temperature: float, *, with_entropy: bool,
        entropy_grad: bool = True, kept_rule: KeptSetRule | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        rule = kept_rule if kept_rule is not None and kept_rule.truncates else None
        # From the chunked head when the model has one (`lm_head.ScoringHead`).
        head = self._heads.get(id(model))
        if head is not None:
            select = None if self.score_all_tokens else batch.loss_mask > 0
            with scoring(head, batch.labels, temperature, with_entropy, select=select, entropy_grad=entropy_grad,
                         kept_ids=batch.kept_ids, rule=rule):
                out = model(**batch.model_inputs()).logits
            if rule is not None:
                self._count_disagreement(out[..., 2], batch.loss_mask > 0)
            return out[..., 0], (out[..., 1] if with_entropy else None)
        logits = model(**batch.model_inputs()).logits
        if batch.kept_ids is None and rule is None:
            logprobs = compute_token_logprobs(logits, batch.labels, temperature)
            return logprobs, (compute_entropy(logits, temperature) if with_entropy else None)
        # Kept sets without the chunked head (a model whose logits are transformed after it): the
        # whole micro-batch's logits at once.
        z = logits.float().reshape(-1, logits.shape[-1]) / temperature
        labels = batch.labels.reshape(-1)
        if rule is not None:
            self._count_disagreement(outside_kept_set(z, labels, rule).reshape(batch.labels.shape), batch.loss_mask > 0)
        if batch.kept_ids is not None:
            z = masked_logits(z, batch.kept_ids.reshape(labels.shape[0], -1))
        lp = z.gather(-1, labels.long().unsqueeze(-1)).squeeze(-1) - torch.logsumexp(z, dim=-1)
        entropy = entropy_of(z if entropy_grad else z.detach()).reshape(batch.labels.shape) if with_entropy else None
        return lp.reshape(batch.labels.shape), entropy

    def _backward(self, loss: torch.Tensor) -> None:
        # FSDP averages gradients over ranks; the loss is already normalised by the global count,
        # so undo the average to get the sum over ranks.
        torch.autograd.backward(loss * self.world_size)

    def _grad_norm(self, model: nn.Module) -> torch.Tensor:
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
        return norm.full_tensor() if isinstance(norm, DTensor) else norm

    # ── weights and checkpoints ─────────────────────────────────────────────────────────────
    def export_weights(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Full tensors under Hugging Face names; with LoRA, the base weights with the adapters
        merged in (W + alpha/r * B @ A) and no adapter tensors, which is what a server loads."""

        def full(tensor: torch.Tensor) -> torch.Tensor:
            out = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
            return out.detach().cpu()

        state = self.policy.state_dict()
        lora = self.config.lora_rank > 0
        scaling = self.config.lora_alpha / max(self.config.lora_rank, 1)
        for name, tensor in state.items():
            if lora and (".lora_A." in name or ".lora_B." in name):
                continue
            value = full(tensor)
            if lora:
                if name.endswith(".base_layer.weight"):
                    prefix = name.removesuffix("base_layer.weight")
                    a, b = (
                        full(state[prefix + "lora_A.default.weight"]),
                        full(state[prefix + "lora_B.default.weight"]),
                    )
                    value = value + scaling * (b @ a)
                name = name.removeprefix("base_model.model.").replace(".base_layer.", ".")
            yield name, value.to(dtype) if dtype is not None else value

    def _app_state(self) -> dict[str, Any]:
        state = {
            "policy": get_model_state_dict(self.policy),
            "policy_optim": get_optimizer_state_dict(self.policy, self.optimizer),
        }
        if self.critic is not None:
            critic, optimizer, _ = self._critic_parts()
            state["critic"] = get_model_state_dict(critic)
            state["critic_optim"] = get_optimizer_state_dict(critic, optimizer)
        return state

    def save(self, path: str | Path, data_position: dict[str, Any] | None = None) -> None:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        # DCP fills an empty optimizer state with a zero-gradient step (Adam step 1); remember
        # which were empty and empty them again, so saving never changes what training does.
        fresh = {"policy": not self.optimizer.state}
        critic_scheduler = None
        if self.critic is not None:
            _, optimizer, scheduler = self._critic_parts()
            fresh["critic"] = not optimizer.state
            critic_scheduler = scheduler.state_dict()
        dcp.save(self._app_state(), checkpoint_id=str(path / "dcp"))
        self._clear_fresh(fresh)
        save_rng(path, self.rank)
        self._write_state(path, data_position, critic_scheduler=critic_scheduler, fresh_optimizers=fresh)
        dist.barrier()

    def _clear_fresh(self, fresh: dict[str, bool]) -> None:
        if fresh.get("policy"):
            self.optimizer.state.clear()
        if fresh.get("critic") and self.critic is not None:
            self._critic_parts()[1].state.clear()

    def load(self, path: str | Path) -> dict[str, Any]:
        path = Path(path)
        meta = self._read_state(path)
        state = self._app_state()
        if self.critic is None:
            state.pop("critic", None)
        dcp.load(state, checkpoint_id=str(path / "dcp"))
        set_model_state_dict(self.policy, state["policy"])
        set_optimizer_state_dict(self.policy, self.optimizer, state["policy_optim"])
        self.scheduler.load_state_dict(meta["scheduler"])
        if self.critic is not None:
            critic, optimizer, scheduler = self._critic_parts()
            set_model_state_dict(critic, state["critic"])
            set_optimizer_state_dict(critic, optimizer, state["critic_optim"])
            scheduler.load_state_dict(meta["critic_scheduler"])
        self._clear_fresh(meta["fresh_optimizers"])
        self._step = int(meta["global_step"])
        load_rng(path, self.rank)
        return dict(meta["data_position"])

