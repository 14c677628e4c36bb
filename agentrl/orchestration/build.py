"""Build every piece of a job from its config before any process starts: `build_job`.

`agentrl validate`, `doctor`, `eval` and `run` all call `build_job(config, purpose)` first, so
anything `validate` accepts, `run` can build, and every error surfaces in seconds, as an
`AgentRLError` naming the config key, instead of minutes later after servers and trainers started.
It builds, in this order: the model directory (`model.path`, converting the built-in default once;
it must hold weights when the trainer or a server agentrl starts will load them),
the chat template and tokenizer, the tool-call parser (`model.tool_parser=auto`: the family the chat
template's markers name, `agentrl.tools.parser_auto`) and the end-of-turn ids, the env class and its
constructor arguments (`env.kwargs` and the job's resources the env takes, in the table's order:
the verifiers worker, the sandbox, the gateway, the shared MCP servers, a judge server and reward
model for the reward, the reward function, the budgets; one env is built to check them), on a
cluster with `cluster.sandbox_hosts` the plan of the sandbox hosts the run starts
(`Job.sandbox_hosts`), the dataset rows (each checked; `data.skip_bad_rows` keeps the bad ones'
numbers), and checks the names the later stages resolve (inference engine, advantage estimator,
trainer backend) and the budgets against each other; the placement plan (`Job.plan`: who runs
where, how weights move) is built and checked by `placement.build_plan`.

Run-level resources reach an env through its constructor, by parameter name: one table of rows
(`job_resources.JOB_RESOURCES`), made here, opened and closed by `Job` (`async with job:`, which
`agentrl run`, `eval` and `check onpolicy` all open, or `Job.aclose`). An env whose `__init__` takes
`sandbox` gets the one sandbox built from `config.sandbox`, `gateway` the one `SharedGateway` of the
job (started by the first episode that needs it), `shared_mcp` the run's `SharedMCPServers` (the MCP
servers its episodes share), `verifiers_worker` the run's one `VerifiersWorker` (the process that
loads and scores verifiers tasksets; it starts when the env's rows are first asked for, which makes
`build_job` start it for env=verifiers without data files), `tool_timeout_s` gets
`rollout.tool_timeout_s`, `max_turns` gets `rollout.max_turns`, `reward_fn` gets the run's reward
function (`reward.function` with `reward.kwargs`; verl's `compute_score` by default; with a judge the
run serves or a reward model, their processes are rows of the job too, closed with it). Setting one
of those again in `env.kwargs` is refused (one knob per budget; `ENV_RESOURCES`), and so is a
`sandbox` section for an env that runs no code. Nothing here starts a server or Ray, and no process
but the verifiers worker above; the sandbox object is made but starts its workers only when first
used.
"""

from __future__ import annotations

import asyncio
import importlib.util
import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Literal

from agentrl.chat import ChatTemplate
from agentrl.config import AgentRLConfig
from agentrl.datasets import LoadedRows, SkippedRow, check_row, load_rows
from agentrl.envs import Env
from agentrl.envs.reward_sources import CombinedReward
from agentrl.envs.rewards import RewardFunction
from agentrl.envs.verifiers_process import VerifiersWorker
from agentrl.errors import AgentRLError, ConfigError, DatasetError, ResourceCloseError
from agentrl.gateway.server import SharedGateway
from agentrl.models import TOOL_CHATML_TEMPLATE, resolve_model_path
from agentrl.orchestration.job_resources import (
    GATEWAY,
    JOB_RESOURCES,
    SANDBOX,
    SHARED_MCP,
    VERIFIERS_WORKER,
    JobResources,
    build_resources,
    build_sandbox,
    env_takes,
    refuse_resource_kwargs,
)
from agentrl.orchestration.placement import PlacementPlan, build_plan
from agentrl.orchestration.sandbox_hosts import SandboxHostsPlan, plan_sandbox_hosts
from agentrl.orchestration.teacher import Teacher, teacher_for_job
from agentrl.registry import ADVANTAGE_ESTIMATORS, ENVS, INFERENCE_ENGINES, TOOL_PARSERS
from agentrl.rollout import AgentLoop, GenerateClient
from agentrl.rollout.agent_loop import end_of_turn_ids
from agentrl.sandboxes.protocol import Sandbox
from agentrl.tools.mcp_shared import SharedMCPServers
from agentrl.tools.parser_auto import AUTO_TOOL_PARSER, pick_tool_parser, template_source
from agentrl.types import ActionParser, truncates_vocabulary

__all__ = [
    "BUILTIN_TEMPLATES", "ENV_RESOURCES", "Job", "build_job", "build_sandbox", "env_arguments", "env_takes",
    "model_and_template",
]

log = logging.getLogger(__name__)

Purpose = Literal["run", "eval"]

BUILTIN_TEMPLATES = {"chatml-tools": TOOL_CHATML_TEMPLATE}

ENV_RESOURCES: dict[str, str | None] = {row.name: row.key for row in JOB_RESOURCES if row.to_env}
"""Constructor parameters through which an env receives the run's resources, and the config key that
sets each (None: the job makes it), so `env.kwargs` cannot set it a second time (`JOB_RESOURCES`)."""


@dataclass
class Job:
    """Everything a `run` or `eval` needs, built and checked (see the module docstring).

    An async context: `async with job:` opens its resources (`resources`, the table of what its envs
    get) and closes them however the block ends; `aclose` closes them too (twice is harmless)."""

    config: AgentRLConfig
    purpose: Purpose
    model_path: str
    template: ChatTemplate
    parser_factory: Callable[[], ActionParser]
    parser_choice: str
    """Which tool-call parser the job uses and why (`model.tool_parser`, or what `auto` read off the
    chat template), as `agentrl validate` prints it."""
    stop_token_ids: tuple[int, ...]
    env_cls: type[Env]
    env_kwargs: dict[str, Any]
    """`env.kwargs` and every resource an env takes, by parameter name: what `make_env` passes."""
    resources: JobResources
    """The job's resource table (`job_resources.JOB_RESOURCES`): sandbox, gateway, shared servers, workers,
    the reward and what it runs on, each opened and closed by the job."""
    reward_fn: RewardFunction | None = None
    """The rule part of the reward (pre-flight checks rows with it); None when the reward has none."""
    own_client: bool = False
    """The caller generates with a client of its own (an eval given one): no engine is started, so
    pre-flight does not check one."""
    train_rows: list[dict[str, Any] | None] = field(default_factory=list)
    """Training rows at their dataset row numbers (the prompt ledger's indices); None where a
    malformed row was skipped (`data.skip_bad_rows`), which `train_skipped` names."""
    train_skipped: list[SkippedRow] = field(default_factory=list)
    val_rows: list[dict[str, Any]] = field(default_factory=list)
    sources: dict[str, list[str]] = field(default_factory=dict)
    """Where the good rows of each split came from (`file row N`), for messages."""
    notes: list[str] = field(default_factory=list)
    plan: PlacementPlan | None = None
    """Who runs where (`placement.build_plan`), checked with the rest of the job."""
    sandbox_hosts: SandboxHostsPlan | None = None
    """On a cluster with `cluster.sandbox_hosts`: the hosts the run starts, whose client replaces
    `sandbox` for the run's envs (`make_env(sandbox=...)`); None otherwise."""
    teacher: Teacher | None = None
    """A run's distillation teacher (`distill.teacher`; its tokenizer checked against the policy's),
    started by pre-flight, used by the run to score each episode, stopped with the job; None without
    `distill` and for an eval."""

    @property
    def sandbox(self) -> Sandbox | None:
        """The sandbox the envs that take one share (its workers start on first use); None for envs that
        run no code."""
        return self.resources.get(SANDBOX)

    @property
    def gateway(self) -> SharedGateway | None:
        """The gateway the envs that take one share (`AgentEnv`); None for envs that take none."""
        return self.resources.get(GATEWAY)

    @property
    def shared_mcp(self) -> SharedMCPServers | None:
        """The MCP servers the run's episodes share (`per_episode: false`) for envs that take `shared_mcp`
        (`McpEnv`); started on first use."""
        return self.resources.get(SHARED_MCP)

    @property
    def verifiers_worker(self) -> VerifiersWorker | None:
        """The process that runs verifiers tasksets, shared by the run's envs that take `verifiers_worker`
        (`VerifiersEnv`); started on first use (restarted after a crash)."""
        return self.resources.get(VERIFIERS_WORKER)

    def make_env(self, **resources: Any) -> Env:
        """A new env for one episode, with the run's resources; `resources` stand in for some of them
        (the client of the sandbox hosts a cluster run started)."""
        return self.env_cls(**{**self.env_kwargs, **resources})

    def agent_loop(self, client: GenerateClient, *, evaluation: bool = False) -> AgentLoop:
        """The AgentLoop over `client` (the router or a server client); `evaluation` samples at
        `eval.temperature` instead of `rollout.temperature`."""
        rollout = self.config.rollout
        if evaluation:
            rollout = rollout.model_copy(update={"temperature": self.config.eval.temperature})
        return AgentLoop(client, self.template, self.parser_factory(), rollout, stop_token_ids=self.stop_token_ids)

    async def __aenter__(self) -> Job:
        """Open the resources that start eagerly (the others start on first use), on this event loop."""
        await self.resources.aopen()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        try:
            await self.aclose()
        except ResourceCloseError:
            if exc_type is None:
                raise
            # the block's own error is the one to see; each close failure was logged where it happened

    async def aclose(self) -> None:
        """Close every resource of the job, in reverse order of the table, each even when another failed
        (then `ResourceCloseError` names each failure), and the teacher. Closing twice is harmless."""
        try:
            if self.teacher is not None:
                await asyncio.to_thread(self.teacher.close)
            await self.resources.aclose()
        finally:
            for row, _ in self.resources.made():  # an env made after this gets none of the closed ones
                if row.close is not None:
                    self.env_kwargs.pop(row.name, None)


def build_job(config: AgentRLConfig, purpose: Purpose, *, own_client: bool = False) -> Job:
    """Build and check every piece of `config` for `purpose` ("run" or "eval"); raise on the first
    problem, with the key that causes it. Starts nothing. `own_client`: the caller generates with a
    client of its own (an eval given one), so no server will load the model's weights."""
    _check_budgets(config)
    _check_objective(config, purpose)
    given_servers = config.inference.engine == "external" or bool(config.inference.urls)
    # the trainer loads the weights in every run; servers agentrl starts load them too
    loads_weights = purpose == "run" or not (own_client or given_servers)
    model_path = _model_path(config, loads_weights=loads_weights)
    template = _template(config, model_path)
    parser_factory, parser_choice = _parser(config, template, model_path)
    stop_ids = set(end_of_turn_ids(template.tokenizer)) | set(config.rollout.extra_stop_token_ids)
    env_cls, env_kwargs, resources = env_arguments(config)
    reward_fn = env_kwargs.get("reward_fn")
    if isinstance(reward_fn, CombinedReward):
        reward_fn = reward_fn.rule  # pre-flight checks the rows with the rule part only (None: no rule)
    job = Job(config, purpose, model_path, template, parser_factory, parser_choice, tuple(sorted(stop_ids)),
              env_cls, env_kwargs, resources, reward_fn, own_client=own_client)
    try:
        _check_env_builds(job)
        _check_names(config, purpose)
        job.plan = build_plan(config, purpose, model_path)
        if job.plan.cluster is not None and job.plan.cluster.count("sandbox"):
            if job.sandbox is None:
                raise ConfigError(f"cluster.sandbox_hosts={config.cluster.sandbox_hosts}: env '{config.env.name}' "
                                  "runs no code in a sandbox, so the hosts would do nothing; remove it.")
            if config.sandbox.name not in ("local", "docker"):
                raise ConfigError(f"cluster.sandbox_hosts: each host serves the sandbox.name backend; "
                                  f"'{config.sandbox.name}' is not one a host can serve (use local or docker).")
            job.sandbox_hosts = plan_sandbox_hosts(config)
        if purpose == "run":
            _check_tensor_parallel(config, model_path)
            job.teacher = teacher_for_job(config, template.tokenizer, config.model.tokenizer or model_path)
        if purpose == "run":
            train = _rows(config, env_cls, "train", job.env_kwargs)
            job.train_rows, job.train_skipped, job.sources["train"] = train.by_index(), train.skipped, train.sources
            val = _optional_val_rows(config, env_cls, job)
            job.val_rows, job.sources["test"] = val.rows, val.sources
            if config.data.num_val_rows:
                job.val_rows = job.val_rows[: config.data.num_val_rows]
        else:
            val = _rows(config, env_cls, "test", job.env_kwargs)
            job.val_rows, job.sources["test"] = val.rows, val.sources
            if config.eval.max_rows:
                job.val_rows = job.val_rows[: config.eval.max_rows]
    except BaseException:
        _close_quietly(job)
        raise
    return job


def _close_quietly(job: Job) -> None:
    try:
        asyncio.run(job.aclose())
    except Exception as exc:  # the build error is what the user needs to see
        log.debug("closing the sandbox after a failed build: %s", exc)


# ── the pieces ──────────────────────────────────────────────────────────────────────────────


def model_and_template(config: AgentRLConfig) -> tuple[str, ChatTemplate]:
    """The policy's model directory (resolved, with weights) and chat template, checked as `build_job` checks
    them: for the jobs that train without an environment (`agentrl sft`, `agentrl dpo`)."""
    model_path = _model_path(config, loads_weights=True)
    return model_path, _template(config, model_path)


def _check_objective(config: AgentRLConfig, purpose: Purpose) -> None:
    """`agentrl run` learns from rewards: the objectives that learn from rows have their own commands."""
    objective = config.algorithm.objective
    if purpose == "run" and objective != "rl":
        command = "sft" if objective == "sft" else "dpo"
        raise ConfigError(
            f"algorithm.objective={objective} trains on rows, not on the environment's rewards: run it with "
            f"'agentrl {command}' (docs/preferences.md), or set algorithm.objective=rl for 'agentrl run'."
        )


def _check_budgets(config: AgentRLConfig) -> None:
    rollout, inference = config.rollout, config.inference
    if rollout.max_tokens_per_turn > rollout.max_total_tokens:
        raise ConfigError(
            f"rollout.max_tokens_per_turn={rollout.max_tokens_per_turn} is more than the whole episode's "
            f"rollout.max_total_tokens={rollout.max_total_tokens}; lower it or raise max_total_tokens."
        )
    if inference.engine != "external" and rollout.max_total_tokens > inference.max_model_len:
        raise ConfigError(
            f"rollout.max_total_tokens={rollout.max_total_tokens} is more than the servers' context, "
            f"inference.max_model_len={inference.max_model_len}: long episodes would be refused by the "
            "server. Raise inference.max_model_len or lower rollout.max_total_tokens."
        )


def _model_path(config: AgentRLConfig, *, loads_weights: bool) -> str:
    try:
        path = resolve_model_path(config.model.path)
    except AgentRLError as exc:
        raise ConfigError(f"model.path: {exc}") from exc
    if not Path(path).is_dir():
        raise ConfigError(
            f"model.path '{config.model.path}' is neither a model directory nor a built-in model "
            "('smollm2-135m-instruct'). Give the path of a Hugging Face model directory (with "
            "config.json and the weights), e.g. model.path=runs/NAME/weights/version-00000006."
        )
    if not (Path(path) / "config.json").is_file():
        raise ConfigError(f"model.path '{path}' has no config.json: it is not a Hugging Face model directory.")
    if loads_weights and not any(Path(path).glob("*.safetensors")) and not any(Path(path).glob("*.bin")):
        raise ConfigError(
            f"model.path '{path}' holds no weights (no *.safetensors or *.bin file; a tokenizer-only "
            "directory?), and this job loads them into the trainer or a server. Give the directory the "
            "model was saved to, e.g. model.path=runs/NAME/weights/version-00000006."
        )
    return path


def _template(config: AgentRLConfig, model_path: str) -> ChatTemplate:
    key = "model.tokenizer" if config.model.tokenizer else "model.path"
    tokenizer_path = config.model.tokenizer or model_path
    if config.model.tokenizer:
        try:
            tokenizer_path = resolve_model_path(config.model.tokenizer)
        except AgentRLError as exc:
            raise ConfigError(f"model.tokenizer: {exc}") from exc
    text = None
    choice = config.model.chat_template
    if choice is not None:
        if choice in BUILTIN_TEMPLATES:
            text = BUILTIN_TEMPLATES[choice]
        elif Path(choice).is_file():
            text = Path(choice).read_text()
        else:
            raise ConfigError(
                f"model.chat_template '{choice}' is neither a built-in ({', '.join(BUILTIN_TEMPLATES)}) "
                "nor a Jinja file."
            )
    try:
        template = ChatTemplate.from_pretrained(tokenizer_path, template=text,
                                                trust_remote_code=config.model.trust_remote_code)
        template.render([{"role": "user", "content": "hi"}])
    except Exception as exc:
        raise ConfigError(f"{key}: cannot load a tokenizer with a chat template from '{tokenizer_path}': "
                          f"{type(exc).__name__}: {exc}") from exc
    if template.template is None and not getattr(template.tokenizer, "chat_template", None):
        raise ConfigError(f"{key}: the tokenizer at '{tokenizer_path}' has no chat template; name one with "
                          "model.chat_template (a Jinja file, or 'chatml-tools').")
    return template


def _parser(config: AgentRLConfig, template: ChatTemplate, model_path: str) -> tuple[Callable[[], ActionParser], str]:
    """The parser class `model.tool_parser` names (with `auto`, the family of the chat template in use) and
    a line saying which it is and why."""
    name = config.model.tool_parser
    try:
        if name == AUTO_TOOL_PARSER:
            source = template.template if template.template is not None else template.tokenizer.chat_template
            where = (f"model.chat_template '{config.model.chat_template}'" if config.model.chat_template
                     else f"the chat template of '{config.model.tokenizer or model_path}'")
            choice = pick_tool_parser(template_source(source), where=where)
            name, why = choice.family, f"auto: {choice.reason}"
        else:
            why = "named by model.tool_parser"
        parser_cls: Callable[[], ActionParser] = TOOL_PARSERS.resolve(name)
        parser_cls()
    except AgentRLError as exc:
        raise ConfigError(f"model.tool_parser: {exc}") from exc
    return parser_cls, f"{name} ({why})"


def env_arguments(config: AgentRLConfig) -> tuple[type[Env], dict[str, Any], JobResources]:
    """The env class `env.name` names, the keyword arguments each env gets (`env.kwargs` plus every
    resource of the job's table it takes) and that table, made, not opened: the caller closes it
    (`JobResources.aclose`; `build_job` hands it to the `Job`). Errors name the key."""
    try:
        env_cls = ENVS.resolve(config.env.name)
    except AgentRLError as exc:
        raise ConfigError(f"env.name: {exc}") from exc
    if not (isinstance(env_cls, type) and issubclass(env_cls, Env)):
        raise ConfigError(f"env.name '{config.env.name}' names {env_cls!r}, not an agentrl.Env subclass.")
    kwargs = dict(config.env.kwargs)
    refuse_resource_kwargs(kwargs, JOB_RESOURCES)
    resources = build_resources(config, env_cls)
    return env_cls, {**kwargs, **resources.env_kwargs()}, resources


def _check_env_builds(job: Job) -> None:
    try:
        env = job.make_env()
    except AgentRLError as exc:
        raise ConfigError(f"env.kwargs: env '{job.config.env.name}' cannot be built: {exc}") from exc
    except (TypeError, ValueError) as exc:
        given = sorted(job.config.env.kwargs)
        raise ConfigError(
            f"env.kwargs: env '{job.config.env.name}' rejected its arguments {given}: {exc}"
        ) from exc
    try:
        env.close()
    except Exception as exc:  # an env that cannot close before reset is its own bug; not fatal here
        log.debug("closing the probe env: %s", exc)


def _check_tensor_parallel(config: AgentRLConfig, model_path: str) -> None:
    """Megatron splits heads, key/value groups, the FFN and the vocabulary over the tensor-parallel
    ranks: refuse a size that does not divide the model's, before any trainer process starts."""
    trainer = config.trainer
    if trainer.backend != "megatron" or trainer.tensor_parallel <= 1:
        return
    from transformers import AutoConfig

    from agentrl.trainer.megatron_convert import gpt_layout_from_hf

    try:
        hf_config = AutoConfig.from_pretrained(model_path, trust_remote_code=config.model.trust_remote_code)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"model.path: cannot read the model's config from {model_path}: {exc}") from exc
    gpt_layout_from_hf(hf_config).check_tensor_parallel(trainer.tensor_parallel)


def _check_names(config: AgentRLConfig, purpose: Purpose) -> None:
    if config.inference.engine == "external":
        if not config.inference.urls:
            raise ConfigError("inference.urls: engine 'external' needs the base URLs of running servers, "
                              "e.g. inference.urls=[http://127.0.0.1:8000].")
        if purpose == "run":
            raise ConfigError("inference.engine: 'external' servers cannot receive new weights, so they "
                              "can evaluate (agentrl eval) but not train; use engine vllm (or servers "
                              "started with 'agentrl serve', given as inference.urls).")
    else:
        try:
            INFERENCE_ENGINES.resolve(config.inference.engine)
        except AgentRLError as exc:
            raise ConfigError(f"inference.engine: {exc}") from exc
    if purpose != "run":
        return
    _check_kept_set_engine(config)
    try:
        ADVANTAGE_ESTIMATORS.resolve(config.algorithm.advantage)
    except AgentRLError as exc:
        raise ConfigError(f"algorithm.advantage: {exc}") from exc
    trainer = config.trainer
    if trainer.backend == "megatron" and importlib.util.find_spec("megatron") is None:
        raise ConfigError("trainer.backend: 'megatron' needs megatron-core; install it with "
                          "pip install 'agentrl[megatron]' (or bash scripts/install.sh megatron).")
    if trainer.lora_rank > 0 and importlib.util.find_spec("peft") is None:
        raise ConfigError("trainer.lora_rank > 0 needs peft; install it with pip install 'agentrl[lora]'.")
    if trainer.tensor_parallel > 1 and trainer.backend != "megatron":
        raise ConfigError("trainer.tensor_parallel > 1 needs trainer.backend=megatron (FSDP2 shards data, "
                          "not tensors).")
    if trainer.tensor_parallel > trainer.num_processes or trainer.num_processes % trainer.tensor_parallel:
        raise ConfigError(f"trainer.num_processes={trainer.num_processes} must be a multiple of "
                          f"trainer.tensor_parallel={trainer.tensor_parallel}.")
    if trainer.device == "cuda" and config.cluster.address is None:
        # on a cluster the ranks run on other nodes: `cluster.trial_placement` checks CUDA on each one
        import torch

        if not torch.cuda.is_available():
            raise ConfigError("trainer.device=cuda but no CUDA device is visible here; use auto or cpu.")
    # weights.backend is checked against the placement: `placement.build_plan`.


KEPT_SET_ENGINES = ("vllm", "hf")
"""Engines that return each sampled token's kept set, so truncated sampling can be replayed."""


def _check_kept_set_engine(config: AgentRLConfig) -> None:
    """Truncated sampling trains only on an engine that returns its kept sets: elsewhere the
    trainer would score the full vocabulary against a nucleus logprob, a biased ratio."""
    rollout, engine = config.rollout, config.inference.engine
    if engine in KEPT_SET_ENGINES or not truncates_vocabulary(rollout.temperature, rollout.top_p,
                                                              rollout.top_k, rollout.min_p):
        return
    on = [f"rollout.{k}={getattr(rollout, k)}" for k, off in (("top_p", 1.0), ("top_k", 0), ("min_p", 0.0))
          if getattr(rollout, k) != off]
    raise ConfigError(
        f"{', '.join(on)}: inference.engine '{engine}' cannot return the kept set each token was sampled "
        "from, so the trainer could not score tokens under the distribution they were drawn from (a "
        f"biased importance ratio). Use inference.engine={' or '.join(KEPT_SET_ENGINES)}, or train with "
        "rollout.top_p=1.0 rollout.top_k=0 rollout.min_p=0.0."
    )


def _rows(config: AgentRLConfig, env_cls: type[Env], split: str, env_kwargs: dict[str, Any]) -> LoadedRows:
    """The rows of `split`: the configured files, else the env's own dataset, every row checked.

    Rows must carry `reward_model.ground_truth` unless the env declares `requires_ground_truth =
    False`. Rows skipped under `data.skip_bad_rows` keep their numbers and are logged, one line each.
    """
    files = config.data.train_files if split == "train" else config.data.val_files
    require_truth = env_cls.requires_ground_truth
    if files:
        loaded = load_rows(files, skip_bad_rows=config.data.skip_bad_rows, require_ground_truth=require_truth)
        for bad in loaded.skipped:
            log.warning("data.skip_bad_rows: skipping %s row %d (dataset row %d): %s",
                        bad.file, bad.row, bad.index, bad.reason)
        return loaded
    # an env whose rows depend on its arguments (env=verifiers: the taskset env.kwargs.id names, loaded by
    # the job's verifiers worker) takes them: env.kwargs with the run's resources, as each env gets them
    dataset_rows: Callable[..., Any] = env_cls.dataset_rows
    takes_kwargs = "env_kwargs" in inspect.signature(dataset_rows).parameters
    rows = dataset_rows(split, env_kwargs=dict(env_kwargs)) if takes_kwargs else dataset_rows(split)
    if rows is None:
        key = "data.train_files" if split == "train" else "data.val_files"
        raise ConfigError(f"{key}: env '{config.env.name}' ships no dataset; give {key}=[path.jsonl or .parquet].")
    loaded = LoadedRows.of(list(rows), f"env '{config.env.name}' {split} split")
    problems = [f"{where}: {problem}" for where, row in zip(loaded.sources, loaded.rows, strict=True)
                if (problem := check_row(row, require_ground_truth=require_truth))]
    if problems:  # a bug in the env, not in the user's data
        raise DatasetError(f"{len(problems)} of the env's own rows are malformed:\n  " + "\n  ".join(problems[:20]))
    return loaded


def _optional_val_rows(config: AgentRLConfig, env_cls: type[Env], job: Job) -> LoadedRows:
    try:
        return _rows(config, env_cls, "test", job.env_kwargs)
    except ConfigError as exc:
        job.notes.append(f"no held-out evaluation: {exc}")
        return LoadedRows()
