"""The small HTTP API every agentrl inference server speaks, as pydantic models.

One request shape and one answer shape per endpoint, shared by the servers (`hf_server`,
`vllm_server`) and by `HTTPServerClient`, so the two sides can never drift apart:

    POST /generate        GenerateRequest      -> GenerateResponse
    GET  /health                               -> HealthResponse
    POST /pause           PauseRequest         -> HealthResponse
    POST /resume                               -> HealthResponse
    POST /update_weights  UpdateWeightsRequest -> UpdateWeightsResponse (a HealthResponse plus the load's report)
    POST /probe_weights   ProbeWeightsRequest  -> ProbeWeightsResponse
    POST /score           ScoreRequest         -> ScoreResponse
    GET  /metrics                              -> MetricsResponse

Every route but /health takes `Authorization: Bearer <token>` when the server has a token
(`SERVER_TOKEN_ENV` in its environment; see `server_app`).

Everything is token ids: text is never sent, so it is never re-tokenised. This module holds the
wire format only; it knows nothing about engines, processes or routing.
"""

from __future__ import annotations

from typing import Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, model_validator

from agentrl.types import Generation, SamplingParams, truncates_vocabulary

__all__ = [
    "MAX_KEPT_SET",
    "SERVER_TOKEN_ENV",
    "GenerateRequest",
    "GenerateResponse",
    "HealthResponse",
    "MetricsResponse",
    "PauseRequest",
    "ProbeWeightsRequest",
    "ProbeWeightsResponse",
    "SamplingSpec",
    "ScoreRequest",
    "ScoreResponse",
    "UpdateWeightsRequest",
    "UpdateWeightsResponse",
    "WeightLoadReport",
]


MAX_KEPT_SET = 1024
"""The largest kept set a request may ask a server to return (`rollout.max_kept_set`'s bound; the
vLLM servers start with `max_logprobs` one above it)."""

SERVER_TOKEN_ENV = "AGENTRL_SERVER_TOKEN"
"""The environment variable holding an agentrl server's bearer token (read by the server and,
when no token is passed, by `HTTPServerClient`)."""


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
    min_p: float = Field(0.0, ge=0.0, lt=1.0)
    max_kept_set: int = Field(128, ge=1, le=MAX_KEPT_SET)
    """Most members of a kept set the server returns per token; a larger set is answered as `[]`
    (overflowed). Kept sets are returned only when the settings truncate the vocabulary."""

    @property
    def truncates(self) -> bool:
        return truncates_vocabulary(self.temperature, self.top_p, self.top_k, self.min_p)

    @classmethod
    def from_params(cls, sampling: SamplingParams) -> SamplingSpec:
        return cls(
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,
            max_tokens=sampling.max_tokens,
            stop_token_ids=list(sampling.stop_token_ids) or None,
            seed=sampling.seed,
            min_p=sampling.min_p,
            max_kept_set=sampling.max_kept_set,
        )


class GenerateRequest(_Wire):
    prompt_ids: list[int] = Field(min_length=1)
    sampling: SamplingSpec = Field(default_factory=SamplingSpec)
    session_id: str = ""


class GenerateResponse(_Wire):
    token_ids: list[int]
    logprobs: list[float]
    """Logprob of each sampled token under the distribution it was drawn from: logits / temperature
    (unscaled for greedy), after min-p/top-k/top-p truncation. See `hf_server` for the convention."""
    finish_reason: Literal["stop", "length", "abort"]
    weight_version: int
    kept_sets: list[list[int]] | None = None
    """Per sampled token, the sorted ids it was drawn from (`[]`: more than `max_kept_set`); None
    when the sampling kept the whole vocabulary (`Generation.kept_sets`)."""

    def to_generation(self, server_id: str = "") -> Generation:
        return Generation(
            token_ids=self.token_ids,
            logprobs=self.logprobs,
            finish_reason=self.finish_reason,
            weight_version=self.weight_version,
            server_id=server_id,
            kept_sets=self.kept_sets,
        )


class HealthResponse(_Wire):
    status: Literal["ok", "paused", "loading"]
    """"loading": the server does not serve (it is starting, or a weight push failed part-way and
    its weights are a mix of two versions until a push succeeds; `detail` says which)."""
    weight_version: int
    model: str
    engine: str
    load: int
    """Requests running or waiting on this server right now."""
    detail: str | None = None
    """Why the server is not serving, when it is not."""
    max_model_len: int | None = None
    """The longest sequence (prompt plus generation) the server accepts; None: it does not say."""


class PauseRequest(_Wire):
    abort: bool = False
    """False: wait for in-flight requests to finish. True: end them now with finish_reason "abort"."""


class UpdateWeightsRequest(_Wire):
    source: str = Field(validation_alias=AliasChoices("source", "path"))
    """Where the weights are: a directory of safetensors files on the server's machine (the files
    engine's `weights/version-N`, or any Hugging Face model directory), or the http(s) URL of a
    trainer's weight endpoint (the http engine). Tensor names must match the served model's."""
    version: int = Field(ge=0)
    token: str | None = None
    """The bearer token of a weight endpoint (never logged)."""


class WeightLoadReport(_Wire):
    """What one server did with one weight push: every bucket counted, every checksum compared."""

    version: int
    source: str
    buckets: int
    verified_buckets: int
    """Buckets whose checksum matched the sender's before any of their tensors was loaded."""
    unverified_buckets: int = 0
    """Buckets that carried no checksum (a foreign checkpoint directory)."""
    retried_buckets: int = 0
    """Buckets fetched again after a failed check or a broken connection."""
    bytes: int
    checksum: str | None
    seconds: float
    """The load, from its first bucket to its last tensor in the engine (transfer and load overlap)."""
    receive_seconds: float = 0.0
    """Of `seconds`, the time spent waiting for buckets and checking them; the rest loaded them."""
    pause_seconds: float = 0.0
    """Before the load: the time the server waited for its requests in flight to finish."""


class UpdateWeightsResponse(HealthResponse):
    push: WeightLoadReport


class ProbeWeightsRequest(_Wire):
    source: str
    """A weights directory (files engine) or a trainer's weight endpoint URL (http engine)."""
    token: str | None = None


class ProbeWeightsResponse(_Wire):
    nonce: str | None = None
    """What the source holds (the run compares it with what the trainer wrote); None on error."""
    error: str | None = None


class ScoreRequest(_Wire):
    """Score given token ids under the served weights: no sampling, nothing generated.

    The answer holds `log p(token_ids[i] | token_ids[:i])` for every i from `start` to the end, under
    the model's raw distribution: `log_softmax(logits)` at temperature 1 over the whole vocabulary
    (no temperature, no truncation), the quantity a trainer computes for the same ids. This is the
    call the served-policy check and a distillation teacher use."""

    token_ids: list[int] = Field(min_length=2)
    start: int = Field(1, ge=1)
    """The first position scored (position 0 has no context, so it is never scored)."""
    session_id: str = ""

    @model_validator(mode="after")
    def _start_inside(self) -> ScoreRequest:
        if self.start >= len(self.token_ids):
            raise ValueError(f"start={self.start} leaves nothing to score in {len(self.token_ids)} token ids; "
                             "pass a start below the number of ids")
        return self


class ScoreResponse(_Wire):
    logprobs: list[float]
    """`logprobs[k]` is the logprob of `token_ids[start + k]` given the ids before it (see `ScoreRequest`)."""
    weight_version: int
    """The weight version that computed these scores."""


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
    weight_buckets_verified: int = 0
    """Weight buckets whose checksum this server compared with the sender's, over all pushes."""
    weight_bytes_received: int = 0
    weight_buckets_retried: int = 0
    weight_load_failures: int = 0
    """Pushes that failed on this server (a corrupted bucket, an unreachable source, a wrong model)."""
    scored_tokens: int = 0
    """Token positions scored by `POST /score`, over all requests."""
