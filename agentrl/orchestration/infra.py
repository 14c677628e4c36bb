"""Infrastructure failures stop a run: `InfraMonitor` watches the share of episodes that failed.

An episode fails for infrastructure reasons (`Trajectory.fault == "infra"`) when something other
than the model broke: no sandbox, a sandbox process that died, a tool or generation deadline, a
dead server. Such episodes are never trained on or scored (they are masked, their prompts are
requeued), so a run where most episodes fail that way is not learning, however long it runs.
`InfraMonitor` keeps the last `run.infra_failure_window` episodes; once it holds a step's worth
(or the whole window, if smaller) and more than `run.max_infra_failure_rate` of them failed, it
raises `InfraFailureError`, whose message names the commonest
cause and its fix. `agentrl eval` applies the same threshold to its episodes.
"""

from __future__ import annotations

import collections
import re
from collections.abc import Iterable

from agentrl.errors import InfraFailureError
from agentrl.types import Trajectory

__all__ = ["InfraMonitor", "describe_infra_failures", "fix_for"]

# What to do about the commonest causes, found by what their error text says.
_FIXES: tuple[tuple[str, str], ...] = (
    (r"the distillation teacher", "the teacher model (distill.teacher, named above with its log) died, is too "
                                  "slow or refused the episode's ids: see its log; check distill.teacher.model_path "
                                  "/ url and engine, and raise distill.teacher.timeout_s if it is only slow"),
    (r"the reward judge the run serves", "the judge model the run serves (reward.judge.model_path) did not start, "
                                         "died, is too slow or answers in a form its verdict schema cannot read: "
                                         "see its log named above; check reward.judge.model_path, engine, "
                                         "server_args, startup_timeout_s, timeout_s and verdict_regex / prompt"),
    (r"the reward judge at", "the reward judge (reward.judge.url, named above) is down, too slow or answers in a "
                             "form its verdict schema cannot read: check that its server is up at that URL, "
                             "reward.judge.model, reward.judge.timeout_s and reward.judge.verdict_regex / prompt"),
    (r"the reward model ", "the reward model process (reward.model.path) failed: see the error above and the "
                           "driver log; check reward.model.path, max_length and timeout_s"),
    (r"reward missing \(infra\): the reward function",
     "the reward function (reward.function) raised: fix it, and check it with 'agentrl validate'"),
    (r"test command could not start",
     "an SWE instance's test command does not run in its sandbox (a missing runner or conda env): run "
     "'agentrl swe check' on the instances to list the broken ones"),
    (r"killed during grading",
     "the sandbox or the test run was killed while grading (docker kill, a daemon restart, the memory "
     "limit): see the daemon's log, or raise the sandbox's memory limit"),
    (r"bubblewrap|bwrap", "install bubblewrap ('bash scripts/install.sh' does, or 'apt-get install "
                          "bubblewrap'), or pick another sandbox with sandbox=docker"),
    (r"docker", "start the Docker daemon ('bash scripts/install.sh docker' does) or use sandbox=local"),
    (r"the OpenEnv server .* at capacity", "the env's OpenEnv server (env.kwargs.url) accepts fewer sessions at "
                                            "once than agentrl plays episodes: set rollout.max_concurrent_episodes "
                                            "to its max_concurrent_envs (named above), serve it with a higher one, "
                                            "or use env.kwargs.command (one server per episode)"),
    (r"the OpenEnv server", "the env's OpenEnv server (named above) died, closed its session or stopped "
                            "answering: see its output in the error, check env.kwargs.url / command and "
                            "env.kwargs.message_timeout_s"),
    (r"MCP server '", "an MCP tool server (env.kwargs.servers, named above) crashed, hung or broke the protocol: "
                      "run its command by hand to see why; raise rollout.tool_timeout_s for slow tools"),
    (r"the verifiers worker", "the verifiers worker process (which loads and scores the taskset) died or hung "
                              "(killed, out of memory, a reward that exits or blocks its event loop): see its "
                              "stderr in the error; the next episode gets a fresh worker"),
    (r"the verifiers episode", "verifiers could not play the episode of the task named above (its env's run(), "
                               "its chat program or a model call raised, or it ran past its deadline): see the "
                               "error; raise rollout.episode_timeout_s (or env.kwargs.timeout_s) if it is slow"),
    (r"the verifiers rubric|the verifiers rewards", "the verifiers taskset's reward code failed or hung (named "
                                                    "above): fix it, or raise env.kwargs.score_timeout_s"),
    (r"did not answer within|deadline|ran out of time|did not finish within",
     "a tool or generation took longer than its deadline: raise rollout.tool_timeout_s / "
     "rollout.request_timeout_s, or lower the load (rollout.max_concurrent_episodes)"),
    (r"server|connect|HTTP 5\d\d", "an LLM server stopped answering: see the server logs under the run's logs/ folder"),
    (r"sandbox", "the sandbox failed: run 'agentrl doctor' with the same config to see why"),
)


def fix_for(error: str) -> str:
    """What to do about an infrastructure error, judged by its text."""
    for pattern, fix in _FIXES:
        if re.search(pattern, error, re.I):
            return fix
    return "see the full errors in the log (a run's driver.log) and fix their cause"


def describe_infra_failures(trajectories: Iterable[Trajectory]) -> tuple[str, int]:
    """The commonest infrastructure error among `trajectories` (shortened) and how many had it."""
    counts = collections.Counter(_short(t.error or "unknown error") for t in trajectories if t.fault == "infra")
    if not counts:
        return "", 0
    return counts.most_common(1)[0]


def _short(error: str) -> str:
    # Episode-specific details (ids, numbers) would split one cause into many.
    return re.sub(r"\b[0-9a-f]{16,}\b", "<id>", error.strip().splitlines()[0] if error.strip() else error)[:300]


class InfraMonitor:
    """The share of infrastructure failures over the last `window` episodes (see the module docstring)."""

    def __init__(self, max_rate: float, window: int, *, min_episodes: int = 1, resume_command: str = "") -> None:
        """`resume_command`: the command that continues the run once the cause is fixed
        (`run_commands.resume_command`), the last line of the message."""
        self.max_rate = max_rate
        self.resume_command = resume_command
        self.window: collections.deque[Trajectory] = collections.deque(maxlen=window)
        self.min_episodes = max(1, min(min_episodes, window))
        self.total = 0
        self.failed = 0

    def record(self, trajectories: Iterable[Trajectory]) -> None:
        for t in trajectories:
            self.window.append(t)
            self.total += 1
            self.failed += t.fault == "infra"

    @property
    def rate(self) -> float:
        if not self.window:
            return 0.0
        return sum(t.fault == "infra" for t in self.window) / len(self.window)

    def check(self) -> None:
        """Raise `InfraFailureError` when the window's failure rate is above the limit (once the
        window holds at least `min_episodes`: one step's worth, so a broken run stops in its first step)."""
        if len(self.window) < self.min_episodes:
            return
        if self.max_rate >= 1.0 or self.rate <= self.max_rate:
            return
        raise InfraFailureError(self.message())

    def message(self) -> str:
        n = len(self.window)
        bad = sum(t.fault == "infra" for t in self.window)
        cause, count = describe_infra_failures(self.window)
        return (
            f"{bad} of the last {n} episodes ({bad / n:.0%}) failed for infrastructure reasons, more than "
            f"run.max_infra_failure_rate={self.max_rate:g}; they are never trained on, so the run stops "
            f"here. Commonest cause ({count} episodes): {cause}\nFix: {fix_for(cause)}."
            + (f"\nThen continue the run with: {self.resume_command}" if self.resume_command else "")
        )
