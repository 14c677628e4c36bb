"""`hf`: a small, exact, slow inference server built on transformers, for machines without vLLM.

Run it as `python -m agentrl.inference.hf_server --model PATH --port N` (or `launch_server("hf",
PATH)`). The model is an `AutoModelForCausalLM` in float32 on CPU; requests are served one at a
time, token by token with a KV cache, in a worker thread so `/health` keeps answering. It is meant
to be correct and easy to read, not fast, and it is not the default engine (vLLM is).

Logprob convention (the same for every agentrl server): the logprob reported for a sampled token is
its logprob under the distribution it was actually drawn from: `log_softmax(logits / temperature)`
restricted to the kept set (min-p, top-k, top-p, in vLLM's order: `agentrl.kept_set`)
and renormalised over it; the kept set of each token is answered too (`kept_sets`), so the
trainer replays it. With the RL defaults (top_p=1, top_k off, min_p=0) that is exactly
`log_softmax(logits / temperature)[token]` over the full vocabulary and no kept set is sent. With temperature 0 (greedy) the
logits are not scaled. vLLM reports the same quantity with `logprobs_mode="processed_logprobs"`.

Scoring (`POST /score`) is one forward pass over the given ids: the raw `log_softmax(logits)` of
each id given the ids before it, as the trainer computes it.

Seeds are honoured: the same prompt, sampling parameters and seed give the same tokens. Generation
ends at a stop token id (by default the EOS ids of the model's generation_config; the stop token is
included in the output), at `max_tokens`, or at the model's maximum length ("length").
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from agentrl.errors import ConfigError
from agentrl.inference.protocol import (
    GenerateRequest,
    GenerateResponse,
    ScoreRequest,
    ScoreResponse,
    WeightLoadReport,
)
from agentrl.inference.server_app import (
    ServerEngine,
    WeightLoadError,
    run_server,
    server_arg_parser,
    weight_load_report,
)
from agentrl.kept_set import kept_mask, kept_sets_of
from agentrl.types import truncates_vocabulary

__all__ = ["HFEngine", "main", "sample_token"]

_DTYPES = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def sample_token(
    logits: torch.Tensor, temperature: float, top_p: float, top_k: int, generator: torch.Generator | None,
    *, min_p: float = 0.0, max_kept_set: int = 0,
) -> tuple[int, float, list[int] | None]:
    """Draw one token from 1-D `logits`; return it with its logprob (see the module convention) and,
    when the settings truncate the vocabulary, its kept set (sorted ids; `[]` past `max_kept_set`)."""
    logits = logits.float()
    if temperature == 0:
        token = int(torch.argmax(logits))
        return token, float(torch.log_softmax(logits, dim=-1)[token]), None
    scaled = logits / temperature
    truncating = truncates_vocabulary(temperature, top_p, top_k, min_p)
    keep = kept_mask(scaled, top_k=top_k, top_p=top_p, min_p=min_p) if truncating else None
    masked = scaled if keep is None else scaled.masked_fill(~keep, float("-inf"))
    logp = torch.log_softmax(masked, dim=-1)
    token = int(torch.multinomial(logp.exp(), 1, generator=generator))
    kept = kept_sets_of(keep.unsqueeze(0), max_kept_set)[0] if keep is not None else None
    return token, float(logp[token]), kept


class HFEngine(ServerEngine):
    """A transformers model generating one request at a time, in a worker thread."""

    engine_name = "hf"

    def __init__(
        self, model_path: str, *, num_threads: int | None = None, trust_remote_code: bool = False,
        dtype: str = "auto",
    ) -> None:
        if dtype not in _DTYPES:
            raise ConfigError(f"model.dtype '{dtype}' is not one of {', '.join(_DTYPES)}.")
        self.model_path = model_path
        self.dtype = dtype
        self.trust_remote_code = trust_remote_code
        self.model_name = Path(model_path).name or model_path
        self.num_threads = num_threads
        self.model: Any = None
        self.eos_ids: list[int] = []
        self.max_len = 1 << 30
        self._lock = asyncio.Lock()  # one generation (or weight load) at a time
        self._abort_epoch = 0

    def torch_dtype(self) -> torch.dtype:
        """The weights' dtype: `model.dtype`; `auto` is float32, as this engine runs on the CPU (where the
        trainer computes in float32 too, and bfloat16 without AVX512-BF16 is emulated, many times slower)."""
        return _DTYPES[self.dtype] or torch.float32

    async def start(self) -> None:
        await asyncio.to_thread(self._load)

    def _load(self) -> None:
        from transformers import AutoModelForCausalLM, GenerationConfig

        if self.num_threads:
            torch.set_num_threads(self.num_threads)
        # AGENTRL_HF_DEVICE=cuda puts the model on the GPU (bench/onpolicy_gpu.py); the default is the CPU.
        self.device = torch.device(os.environ.get("AGENTRL_HF_DEVICE", "cpu"))
        self.model = AutoModelForCausalLM.from_pretrained(
            self.model_path, dtype=self.torch_dtype(), trust_remote_code=self.trust_remote_code
        ).eval().to(self.device)  # type: ignore[no-untyped-call]  # transformers leaves eval() unannotated
        eos: Any = None
        try:
            eos = GenerationConfig.from_pretrained(self.model_path).eos_token_id
        except OSError:
            eos = self.model.config.eos_token_id
        self.eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
        self.max_len = int(getattr(self.model.config, "max_position_embeddings", self.max_len))

    # ── generation ──────────────────────────────────────────────────────────────────────────
    async def generate(self, request: GenerateRequest, version: int) -> GenerateResponse:
        epoch = self._abort_epoch  # taken before queueing, so an abort also ends queued requests
        async with self._lock:
            ids, lps, kept, reason = await asyncio.to_thread(self._generate, request, epoch)
        return GenerateResponse(token_ids=ids, logprobs=lps, finish_reason=reason, weight_version=version,
                                kept_sets=kept if request.sampling.truncates else None)

    @torch.inference_mode()
    def _generate(
        self, request: GenerateRequest, epoch: int
    ) -> tuple[list[int], list[float], list[list[int]], Any]:
        s = request.sampling
        stop = set(self.eos_ids if s.stop_token_ids is None else s.stop_token_ids)
        gen = torch.Generator().manual_seed(s.seed if s.seed is not None else int.from_bytes(os.urandom(7)))
        ids: list[int] = []
        lps: list[float] = []
        kept_sets: list[list[int]] = []
        room = self.max_len - len(request.prompt_ids)
        if room <= 0:
            return ids, lps, kept_sets, "length"
        device = getattr(self, "device", torch.device("cpu"))
        inputs = torch.tensor([request.prompt_ids], dtype=torch.long, device=device)
        past = None
        while True:
            if self._abort_epoch != epoch:
                return ids, lps, kept_sets, "abort"
            out = self.model(input_ids=inputs, past_key_values=past, use_cache=True)
            past = out.past_key_values
            token, lp, kept = sample_token(out.logits[0, -1].cpu(), s.temperature, s.top_p, s.top_k, gen,
                                           min_p=s.min_p, max_kept_set=s.max_kept_set)
            ids.append(token)
            lps.append(lp)
            if kept is not None:
                kept_sets.append(kept)
            if token in stop:
                return ids, lps, kept_sets, "stop"
            if len(ids) >= min(s.max_tokens, room):
                return ids, lps, kept_sets, "length"
            inputs = torch.tensor([[token]], dtype=torch.long, device=device)

    async def abort_all(self) -> None:
        self._abort_epoch += 1

    # ── scoring ─────────────────────────────────────────────────────────────────────────────
    async def score(self, request: ScoreRequest, version: int) -> ScoreResponse:
        async with self._lock:
            logprobs = await asyncio.to_thread(self._score, request.token_ids, request.start)
        return ScoreResponse(logprobs=logprobs, weight_version=version)

    @torch.inference_mode()
    def _score(self, token_ids: list[int], start: int) -> list[float]:
        """One forward pass over `token_ids`; the raw logprob of each id from `start` on (`ScoreRequest`)."""
        device = getattr(self, "device", torch.device("cpu"))
        logits = self.model(input_ids=torch.tensor([token_ids], dtype=torch.long, device=device)).logits[0]
        logp = torch.log_softmax(logits[start - 1 : -1].float(), dim=-1)
        targets = torch.tensor(token_ids[start:], dtype=torch.long, device=logp.device)
        return [float(x) for x in logp.gather(1, targets.unsqueeze(1)).squeeze(1).cpu()]

    # ── weights ─────────────────────────────────────────────────────────────────────────────
    async def load_weights(self, source: str, *, version: int, token: str | None) -> WeightLoadReport:
        async with self._lock:
            return await asyncio.to_thread(self._load_weights, source, version, token)

    async def load_tensors(self, open_stream: Callable[[], Iterable[tuple[str, Any]]]) -> int:
        """Load the weights `open_stream()` yields (Hugging Face names) in place, when this engine
        lives in the trainer's process (an in-memory push, as `colocated.InProcessVLLM.load_tensors`);
        return how many tensors came. A name the model does not have is an error."""
        from agentrl.weights import load_into_module

        async with self._lock:
            report = await asyncio.to_thread(load_into_module, self.model, open_stream(), strict=False,
                                             allow_cast=True)
        if report.unexpected or report.missing:
            raise WeightLoadError(
                f"the in-memory push does not match the model: {len(report.unexpected)} pushed tensors match no "
                f"parameter (e.g. {report.unexpected[:3]}), {len(report.missing)} parameters got nothing (e.g. "
                f"{report.missing[:3]}); trainer and engine must hold the same architecture", touched=bool(report.loaded))
        return len(report.loaded)

    def _load_weights(self, source: str, version: int, token: str | None) -> WeightLoadReport:
        """Stream verified buckets from `source` into the model (`load_into_module`, cast to its dtype)."""
        from agentrl.weights import load_into_module, receive_weights

        start = time.perf_counter()
        applied = 0

        def counted(stream: Any) -> Any:
            nonlocal applied
            for item in stream:
                applied += 1
                yield item

        try:
            with receive_weights(source, version=version, token=token, owned=False) as stream:
                report = load_into_module(self.model, counted(stream), strict=False, allow_cast=True)
        except Exception as exc:
            raise WeightLoadError(f"{type(exc).__name__}: {exc}", touched=applied > 0) from exc
        if report.unexpected:
            raise WeightLoadError(
                f"{len(report.unexpected)} tensors match no parameter of the model, e.g. {report.unexpected[:3]}; "
                "trainer and server must serve the same architecture", touched=bool(report.loaded)
            )
        return weight_load_report(source, version, stream.stats.as_dict(), time.perf_counter() - start)


def main(argv: list[str] | None = None) -> None:
    parser = server_arg_parser("hf")
    parser.add_argument("--num-threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--trust-remote-code", action="store_true", help="run the model repository's code")
    parser.add_argument("--dtype", default="auto", choices=list(_DTYPES), help="weights dtype (auto: float32; this engine runs on the CPU)")
    args = parser.parse_args(argv)
    engine = HFEngine(args.model, num_threads=args.num_threads, trust_remote_code=args.trust_remote_code,
                      dtype=args.dtype)
    run_server(
        engine, host=args.host, port=args.port, weight_version=args.weight_version, log_level=args.log_level
    )


if __name__ == "__main__":
    main()
