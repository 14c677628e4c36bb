"""`SGLangClient`: the `InferenceClient` (and router-facing control calls) over SGLang's own server.

SGLang is started with its own launcher (`python -m sglang.launch_server --model-path P --port N`,
which `launch_server("sglang", P)` runs) and spoken to through its native API, translated here:

    generate        POST /generate {input_ids, sampling_params{temperature, top_p, top_k,
                    max_new_tokens, stop_token_ids, ignore_eos, sampling_seed}, return_logprob: true}
                    -> meta_info.output_token_logprobs [[logprob, token_id, text], ...],
                       meta_info.finish_reason.type, meta_info.weight_version
    score           POST /generate {input_ids, sampling_params{max_new_tokens: 1, temperature: 0},
                    return_logprob: true, logprob_start_len: 0}
                    -> meta_info.input_token_logprobs [[logprob, token_id, text], ...] (None first)
    health          GET /health (liveness) + GET /model_info (falling back to /get_model_info)
                    for weight_version
    pause / resume  POST /pause_generation {mode: "abort" | "in_place"} / POST /continue_generation
    update_weights  POST /update_weights_from_disk {model_path, weight_version}

What differs from agentrl's own servers: SGLang's `weight_version` is a string (parsed as an int
here; a non-numeric version reads as 0); /health reports no load, so the router balances SGLang
servers only on its own in-flight counts; `update_weights_from_disk` wants a complete model
directory (config and weights), not bare safetensors; pause without abort freezes in-flight requests
in place (they continue on resume) rather than letting them finish. SGLang needs CUDA, so it cannot
run on the CPU machines this was written on: this translation is tested only against SGLang's
documented request/response shapes with `httpx.MockTransport` (tests/unit/test_inference_clients.py),
never against a live SGLang server. `score` is written the same way, against SGLang's documented
`input_token_logprobs` (its test is marked `gpu`); it has not run against SGLang either.
"""

from __future__ import annotations

from typing import Any, Literal

import httpx

from agentrl.errors import InferenceError, ServerUnavailableError
from agentrl.inference.client import raise_for_status
from agentrl.inference.protocol import HealthResponse, MetricsResponse, ScoreRequest, ScoreResponse
from agentrl.types import Generation, SamplingParams

__all__ = ["SGLangClient", "sglang_request", "sglang_score_request"]

_FINISH: dict[str, Literal["stop", "length", "abort"]] = {
    "stop": "stop",
    "length": "length",
    "abort": "abort",
}


def sglang_request(prompt_ids: list[int], sampling: SamplingParams) -> dict[str, Any]:
    """The body of SGLang's native POST /generate for a token-id prompt."""
    sp: dict[str, Any] = {
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k if sampling.top_k > 0 else -1,  # SGLang's "off" is -1
        "min_p": sampling.min_p,
        "max_new_tokens": sampling.max_tokens,
        "skip_special_tokens": False,
        "no_stop_trim": True,  # keep the stop token in the output, like the other servers
    }
    if sampling.stop_token_ids:
        sp["stop_token_ids"] = list(sampling.stop_token_ids)
    if sampling.seed is not None:
        sp["sampling_seed"] = sampling.seed
    return {
        "input_ids": list(prompt_ids),
        "sampling_params": sp,
        "return_logprob": True,
        "logprob_start_len": -1,
    }


def sglang_score_request(request: ScoreRequest) -> dict[str, Any]:
    """The body of SGLang's native POST /generate that returns the input ids' own logprobs
    (`input_token_logprobs`, from position 0: SGLang's documented `logprob_start_len`); one greedy
    token is generated and ignored. SGLang computes input logprobs from the raw logits."""
    return {
        "input_ids": list(request.token_ids),
        "sampling_params": {"max_new_tokens": 1, "temperature": 0.0, "skip_special_tokens": False},
        "return_logprob": True,
        "logprob_start_len": 0,
    }


def _version(value: Any) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return 0


class SGLangClient:
    """One SGLang server, behind the same interface as `HTTPServerClient`."""

    def __init__(
        self,
        base_url: str,
        *,
        server_id: str | None = None,
        timeout_s: float = 300.0,
        control_timeout_s: float = 10.0,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.server_id = server_id or self.base_url
        self.timeout_s = timeout_s
        self.control_timeout_s = control_timeout_s
        self._http = httpx.AsyncClient(base_url=self.base_url, transport=transport, timeout=timeout_s)

    async def _call(self, method: str, path: str, *, json: Any = None, timeout_s: float | None = None) -> Any:
        try:
            resp = await self._http.request(method, path, json=json, timeout=timeout_s or self.timeout_s)
        except httpx.TimeoutException as exc:
            raise ServerUnavailableError(
                f"SGLang {self.base_url}{path} got no answer within {timeout_s} s"
            ) from exc
        except httpx.TransportError as exc:
            raise ServerUnavailableError(f"Cannot reach the SGLang server at {self.base_url}: {exc}") from exc
        raise_for_status(resp, f"SGLang {method} {self.base_url}{path}")
        return resp.json() if resp.content else {}

    async def generate(
        self,
        prompt_ids: list[int],
        sampling: SamplingParams,
        *,
        session_id: str,
        timeout_s: float | None = None,
    ) -> Generation:
        data = await self._call(
            "POST", "/generate", json=sglang_request(prompt_ids, sampling), timeout_s=timeout_s
        )
        if isinstance(data, list):  # a batch answer to a single prompt
            data = data[0]
        meta = data.get("meta_info") or {}
        pairs = meta.get("output_token_logprobs")
        if pairs is None:
            raise InferenceError(
                f"SGLang {self.base_url} answered without meta_info.output_token_logprobs: {str(data)[:300]}"
            )
        ids = [int(p[1]) for p in pairs]
        lps = [float(p[0]) for p in pairs]
        reason = (meta.get("finish_reason") or {}).get("type", "abort")
        return Generation(
            ids, lps, _FINISH.get(reason, "abort"), _version(meta.get("weight_version")), self.server_id
        )

    async def score(self, token_ids: list[int], *, start: int = 1, session_id: str = "",
                    timeout_s: float | None = None) -> ScoreResponse:
        """The logprobs of `token_ids[start:]` (`ScoreRequest`), from SGLang's input logprobs."""
        request = ScoreRequest(token_ids=list(token_ids), start=start, session_id=session_id)
        data = await self._call("POST", "/generate", json=sglang_score_request(request), timeout_s=timeout_s)
        if isinstance(data, list):
            data = data[0]
        meta = data.get("meta_info") or {}
        pairs = meta.get("input_token_logprobs")
        if pairs is None or len(pairs) != len(token_ids):
            raise InferenceError(
                f"SGLang {self.base_url} answered {'no' if pairs is None else len(pairs)} input_token_logprobs for "
                f"{len(token_ids)} ids to score: {str(data)[:300]}")
        for i in range(start, len(token_ids)):
            if pairs[i][0] is None or int(pairs[i][1]) != token_ids[i]:
                raise InferenceError(f"SGLang {self.base_url}'s input logprob at position {i} is {pairs[i][:2]}, "
                                     f"not a logprob of id {token_ids[i]}")
        return ScoreResponse(logprobs=[float(p[0]) for p in pairs[start:]],
                             weight_version=_version(meta.get("weight_version")))

    async def health(self, timeout_s: float | None = None) -> HealthResponse:
        t = timeout_s or self.control_timeout_s
        await self._call("GET", "/health", timeout_s=t)
        try:
            info = await self._call("GET", "/model_info", timeout_s=t)
        except InferenceError:
            info = await self._call("GET", "/get_model_info", timeout_s=t)
        return HealthResponse(
            status="ok",
            weight_version=_version(info.get("weight_version")),
            model=str(info.get("model_path", "")),
            engine="sglang",
            load=0,
        )

    async def pause(self, *, abort: bool = False, timeout_s: float | None = None) -> HealthResponse:
        await self._call(
            "POST", "/pause_generation", json={"mode": "abort" if abort else "in_place"}, timeout_s=timeout_s
        )
        return await self.health()

    async def resume(self) -> HealthResponse:
        await self._call("POST", "/continue_generation", json={}, timeout_s=self.control_timeout_s)
        return await self.health()

    async def update_weights(
        self, path: str, version: int, *, timeout_s: float | None = None
    ) -> HealthResponse:
        body = {"model_path": str(path), "weight_version": str(version)}
        data = await self._call("POST", "/update_weights_from_disk", json=body, timeout_s=timeout_s)
        if not data.get("success", False):
            raise InferenceError(
                f"SGLang {self.base_url} could not load weights from {path}: {data.get('message')}"
            )
        return await self.health()

    async def metrics(self) -> MetricsResponse:
        """SGLang exposes Prometheus text, not these counters; nothing is reported."""
        return MetricsResponse()

    async def aclose(self) -> None:
        await self._http.aclose()
