"""The small HTTP API every agentrl inference server speaks, as pydantic models.

One request shape and one answer shape per endpoint, shared by the servers (`hf_server`,
`vllm_server`) and by `HTTPServerClient`, so the two sides can never drift apart:

    POST /generate        GenerateRequest      -> GenerateResponse
    GET  /health                               -> HealthResponse
    POST /pause           PauseRequest         -> HealthResponse
    POST /resume                               -> HealthResponse
    POST /update_weights  UpdateWeightsRequest -> HealthResponse
    GET  /metrics                              -> MetricsResponse

Everything is token ids: text is never sent, so it is never re-tokenised. This module holds the
wire format only; it knows nothing about engines, processes or routing.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from agentrl.types import Generation, SamplingParams

__all__ = [
    "GenerateRequest",
    "GenerateResponse",
    "HealthResponse",
    "MetricsResponse",
    "PauseRequest",
    "SamplingSpec",
    "UpdateWeightsRequest",
]


class _Wire(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SamplingSpec(_Wire):
    """How to sample; the wire twin of `agentrl.types.SamplingParams` (text stops are not sent)."""

    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = -1
    max_tokens: int = Field(512, ge=1)
    stop_token_ids: list[int] | None = None
    """Ids that end the generation. None: the model's EOS ids (generation_config); a list replaces
    them ([] stops only at max_tokens). SamplingParams' empty default travels as None. (SGLang and
    external servers add explicit ids to their EOS instead of replacing it.)"""
    seed: int | None = None

    @classmethod
    def from_params(cls, sampling: SamplingParams) -> SamplingSpec:
        return cls(
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,
            max_tokens=sampling.max_tokens,
            stop_token_ids=list(sampling.stop_token_ids) or None,
            seed=sampling.seed,
        )


class GenerateRequest(_Wire):
    prompt_ids: list[int] = Field(min_length=1)
    sampling: SamplingSpec = Field(default_factory=SamplingSpec)
    session_id: str = ""


class GenerateResponse(_Wire):
    token_ids: list[int]
    logprobs: list[float]
    """Logprob of each sampled token under the distribution it was drawn from: logits / temperature
    (unscaled for greedy), after top-k/top-p truncation. See `hf_server` for the convention."""
    finish_reason: Literal["stop", "length", "abort"]
    weight_version: int

    def to_generation(self, server_id: str = "") -> Generation:
        return Generation(
            token_ids=self.token_ids,
            logprobs=self.logprobs,
            finish_reason=self.finish_reason,
            weight_version=self.weight_version,
            server_id=server_id,
        )


class HealthResponse(_Wire):
    status: Literal["ok", "paused", "loading"]
    weight_version: int
    model: str
    engine: str
    load: int
    """Requests running or waiting on this server right now."""
    max_model_len: int | None = None
    """The longest sequence (prompt plus generation) the server accepts; None: it does not say."""


class PauseRequest(_Wire):
    abort: bool = False
    """False: wait for in-flight requests to finish. True: end them now with finish_reason "abort"."""


class UpdateWeightsRequest(_Wire):
    path: str
    """A directory of safetensors files whose tensor names match the served model's."""
    version: int = Field(ge=0)


class MetricsResponse(_Wire):
    requests: int = 0
    aborted: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    prefix_cache_queries: int | None = None
    """Prompt tokens looked up in the prefix cache (None: the engine does not report it)."""
    prefix_cache_hits: int | None = None
    """Prompt tokens found in the prefix cache (None: the engine does not report it)."""
    weight_updates: int = 0
