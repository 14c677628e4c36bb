"""The one exception tree of agentrl.

Every error agentrl raises on purpose derives from `AgentRLError`, so a caller can catch them all
at once, or one branch at a time. Messages say what failed, what was given and what to do next.
This module holds no logic beyond the classes; it is imported by everything and imports nothing.

    AgentRLError
    ├── ConfigError                  a config file, key or value is wrong
    │   └── UnknownNameError         a registry name or key matched nothing (carries suggestions)
    ├── FeatureUnavailableError      a part that is not built yet, or whose optional extra is missing
    ├── EnvError                     an environment was used against its contract
    │   ├── EnvContractError         `check_env` found a violation
    │   └── EnvServerError           what an env of another standard runs on failed (its server, its rubric)
    ├── ToolError                    a tool failed; `fault` says whose fault it was
    │   ├── ToolArgumentError        the model passed arguments that do not fit the schema
    │   └── ToolInfrastructureError  the machinery behind the tool failed (sandbox down, timeout)
    ├── ToolCallParseError           model text that looked like a tool call but is not one
    ├── ChatTemplateError            a chat template cannot render the messages it was given
    ├── SandboxError                 a sandbox backend cannot do what was asked
    │   ├── SandboxUnavailableError  the isolation tools it needs are missing
    │   ├── SandboxClosedError       the session was already closed
    │   └── GradingError             hidden tests could not be run or judged; `cause` names why
    ├── InferenceError               an LLM server or the router failed
    │   ├── ServerUnavailableError   no healthy server answered in time
    │   └── InferenceRequestError    a server refused one request (HTTP 4xx: too long, bad parameters)
    ├── RewardMissingError           an episode's reward could not be measured; `cause` names why
    ├── DatasetError                 a dataset file or row is malformed
    ├── TrainerError                 the trainer cannot proceed
    ├── CheckpointError              a checkpoint cannot be written, or none intact can be read
    ├── RunWriteError                a run's record cannot be written: disk full, read-only, directory gone
    ├── StartupError                 a part the run starts (Ray, an engine, the trainer, a sandbox) did not start
    │   └── ChildNotReadyError       a child process exited or was not ready in time (`agentrl.child_process`)
    ├── ResourceCloseError           one or more of a job's resources did not close; `failures` names each
    ├── WeightSyncError              a weight push failed
    │   ├── ChecksumError            a bucket arrived corrupted
    │   └── ServedPolicyError        a replica serves other weights than the trainer's after a push
    ├── InfraFailureError            too many episodes failed for infrastructure reasons
    └── PreflightError               a pre-flight check found the job cannot do useful work
"""

from __future__ import annotations

from typing import Any, Literal

__all__ = [
    "AgentRLError",
    "ChatTemplateError",
    "CheckpointError",
    "ChecksumError",
    "ChildNotReadyError",
    "ConfigError",
    "DatasetError",
    "EnvContractError",
    "EnvError",
    "EnvServerError",
    "FeatureUnavailableError",
    "GradingError",
    "InferenceError",
    "InferenceRequestError",
    "InfraFailureError",
    "PreflightError",
    "ResourceCloseError",
    "RewardMissingError",
    "RunWriteError",
    "SandboxClosedError",
    "SandboxError",
    "SandboxUnavailableError",
    "ServedPolicyError",
    "ServerUnavailableError",
    "StartupError",
    "ToolArgumentError",
    "ToolCallParseError",
    "ToolError",
    "ToolInfrastructureError",
    "TrainerError",
    "UnknownNameError",
    "WeightSyncError",
]


class AgentRLError(Exception):
    """Base of every error agentrl raises on purpose."""


class ConfigError(AgentRLError, ValueError):
    """A configuration is invalid. `errors` holds every problem found, one line each."""

    def __init__(self, message: str, errors: list[str] | None = None) -> None:
        super().__init__(message)
        self.errors: list[str] = list(errors) if errors else [message]


class UnknownNameError(ConfigError, LookupError):
    """A name matched no registry entry or config key; `suggestions` holds the closest ones."""

    def __init__(self, message: str, suggestions: list[str] | None = None) -> None:
        super().__init__(message)
        self.suggestions: list[str] = list(suggestions or [])


class FeatureUnavailableError(AgentRLError, NotImplementedError):
    """The requested part is not built yet, or needs an optional extra that is not installed."""


class EnvError(AgentRLError):
    """An environment was used against its contract (for example `step` before `reset`)."""


class EnvContractError(EnvError):
    """`agentrl.envs.check_env` found that an environment breaks the Env contract."""


class EnvServerError(EnvError):
    """The machinery an adapted environment runs on failed: an OpenEnv server died or did not answer, a
    verifiers rubric raised or timed out. The AgentLoop records the episode as fault "infra" (masked)."""


class ToolError(AgentRLError):
    """A tool call failed. `fault` is "model" (bad call) or "infra" (the machinery failed)."""

    fault: Literal["model", "infra"] = "model"


class ToolArgumentError(ToolError):
    """The model's arguments do not fit the tool's schema; the message is shown to the model."""

    fault = "model"


class ToolInfrastructureError(ToolError):
    """The machinery behind a tool failed: sandbox down, service timeout, lost connection."""

    fault = "infra"


class ToolCallParseError(AgentRLError):
    """Text that looked like a tool call could not be parsed into one."""


class ChatTemplateError(AgentRLError, ValueError):
    """A chat template could not render messages (bad role order, missing fields, no template)."""


class SandboxError(AgentRLError):
    """A sandbox backend cannot do what was asked."""


class SandboxUnavailableError(SandboxError):
    """The isolation tools a backend needs are missing; the message names what to install."""


class SandboxClosedError(SandboxError):
    """An operation was attempted on a sandbox session that is already closed."""


class GradingError(SandboxError):
    """Hidden tests could not be run or judged through no fault of the agent (an infrastructure
    failure: the episode is masked, not scored). `cause` is a short, fixed phrase naming why (e.g.
    "the test command could not start"), so reports can count causes; the message adds the details."""

    def __init__(self, message: str, cause: str) -> None:
        super().__init__(message)
        self.cause = cause


class InferenceError(AgentRLError):
    """An LLM server, client or the router failed."""


class ServerUnavailableError(InferenceError):
    """No healthy inference server answered within the deadline.

    `status_code` is the HTTP status when a server answered with a 5xx error, None when it could
    not be reached or did not answer."""

    status_code: int | None = None


class InferenceRequestError(InferenceError):
    """A server refused one request (HTTP 4xx): a prompt longer than its context, bad parameters.

    The server is fine, so the router does not retry elsewhere or mark it failed; the episode ends
    with `fault="request"` and its prompt is filtered with this message as the reason."""

    status_code: int | None = None


class DatasetError(AgentRLError):
    """A dataset file or row is malformed; the message names the file and the row."""


class TrainerError(AgentRLError):
    """The trainer cannot proceed (bad batch, diverged loss, missing checkpoint)."""


class CheckpointError(AgentRLError):
    """A checkpoint could not be written (disk full), or none intact was found to resume from;
    the message names the checkpoint and the file."""


class RunWriteError(AgentRLError):
    """A record of a run (ledger, metrics, rollout log, driver state, identity) could not be written.

    `path` is the file, `cause` a short fixed phrase ("the disk is full", "the disk quota is
    exceeded", "the filesystem is read-only", "permission was denied", "the run directory is gone"),
    `where` the mount and device it lives on, `fix` what to do about it. The command that continues
    the run is only known to the driver: it sets it with `continue_with`, and the message ends with it.
    """

    def __init__(self, path: str, cause: str, detail: str, where: str, fix: str) -> None:
        super().__init__(path, cause, detail, where, fix)  # all five: it survives pickling (Ray)
        self.path, self.cause, self.detail, self.where, self.fix = path, cause, detail, where, fix
        self.continue_command = ""
        self.resume = True

    def continue_with(self, command: str, *, resume: bool = True) -> None:
        """Name the command that continues the run (`resume=False`: it starts again, no checkpoint yet)."""
        self.continue_command, self.resume = command, resume

    def __str__(self) -> str:
        then = ("then resume with: " if self.resume else "then start it again (no checkpoint was written yet) with: ")
        text = (f"Could not write {self.path}: {self.cause} ({self.detail}) on {self.where}. {self.fix}"
                + (f", {then}{self.continue_command}" if self.continue_command else
                   ", then continue the run with resume=true and its run.name") + ".")
        return text


class StartupError(AgentRLError):
    """A part a run starts did not start: Ray, an inference engine, the trainer, a sandbox or its host.

    The message names what failed, why (when known) and what to do; `part` names the part."""

    def __init__(self, message: str, part: str = "") -> None:
        super().__init__(message)
        self.part = part


class ChildNotReadyError(StartupError):
    """A child process agentrl started exited, or did not become ready within its deadline.

    `cause` says how, in `agentrl.child_process`'s words ("exited with code 1", "was killed by signal 9
    (SIGKILL)", "did not become ready within 30 s"); `returncode` is None while it ran (it was then
    stopped), `tail` the end of its log and `log_path` where the log is (None: a temporary file).
    Callers add what to do next, in their own error."""

    def __init__(self, name: str, cause: str, *, returncode: int | None = None, tail: str = "",
                 log_path: str | None = None, timed_out: bool = False) -> None:
        where = f" ({log_path})" if log_path else ""
        super().__init__(f"{name} {cause}; its log{where} ends:\n{tail or '(nothing)'}", part=name)
        self.name = name
        self.cause = cause
        self.returncode = returncode
        self.tail = tail
        self.log_path = log_path
        self.timed_out = timed_out

    def __reduce__(self) -> tuple[Any, tuple[str, str, int | None, str, str | None, bool]]:
        return (_child_not_ready, (self.name, self.cause, self.returncode, self.tail, self.log_path, self.timed_out))


def _child_not_ready(name: str, cause: str, returncode: int | None, tail: str, log_path: str | None,
                     timed_out: bool) -> ChildNotReadyError:
    return ChildNotReadyError(name, cause, returncode=returncode, tail=tail, log_path=log_path, timed_out=timed_out)


class ResourceCloseError(AgentRLError):
    """Closing a job's resources (sandbox, gateway, shared servers, workers) failed for one or more of them.

    Every other one was still closed; `failures` holds (resource name, its error) for each that failed."""

    def __init__(self, failures: list[tuple[str, BaseException]]) -> None:
        self.failures = list(failures)
        named = "; ".join(f"{name} ({type(exc).__name__}: {exc})" for name, exc in self.failures)
        super().__init__(f"closing the job's resources failed for {named}; the others were closed. What "
                         "these started ends with this process (each runs under a lifeline); check their "
                         "logs above for why they did not stop.")


class WeightSyncError(AgentRLError):
    """A weight push from the trainer to the inference servers failed."""


class ChecksumError(WeightSyncError):
    """A weight bucket's checksum did not match what the sender computed."""


class ServedPolicyError(WeightSyncError):
    """After a weight push, a replica's scores of the probe are not the trainer's (`served_policy`)."""


class InfraFailureError(AgentRLError):
    """Too many episodes failed for infrastructure reasons for a run or an evaluation to mean anything."""


class RewardMissingError(AgentRLError):
    """An episode's reward could not be measured (a rule function raised, a judge was down, slow or
    unreadable, a reward model failed). The episode is masked like an infrastructure failure, never
    scored 0. `cause` is one of `CAUSES`; `record` holds what was asked and answered (for the
    trajectory's `info["reward"]`)."""

    CAUSES = ("infra", "timeout", "parse", "truncated")

    def __init__(self, cause: str, message: str, record: dict[str, Any] | None = None) -> None:
        if cause not in self.CAUSES:
            raise ValueError(f"unknown reward-missing cause {cause!r}; use one of {self.CAUSES}")
        super().__init__(f"reward missing ({cause}): {message}")
        self.cause = cause
        self.detail = message
        self.record = dict(record or {})

    def __reduce__(self) -> tuple[type[RewardMissingError], tuple[str, str, dict[str, Any]]]:
        return (type(self), (self.cause, self.detail, self.record))


class PreflightError(AgentRLError):
    """A pre-flight check found that a job cannot do useful work; the message lists each problem and its fix."""
