"""The distillation teacher of a run: `Teacher`, built from `distill.teacher` by `teacher_for_job`.

On-policy distillation (`distill`) needs the logprob a teacher model gives each token the student
sampled, in the same context. The teacher is a served model the job owns, as a judge is: with
`distill.teacher.model_path` the run starts an inference server of it (`engine`, through
`agentrl.inference.launcher`: a `ChildProcess` under a lifeline, so it dies with the run however the
run ends) when pre-flight first scores with it, and `Job.aclose` stops it; with `distill.teacher.url`
it is a server someone else runs (`agentrl serve`). Either way it is reached through the inference
contract's scoring call (`POST /score`, `protocol.ScoreRequest`): it scores token ids, never text.

`Teacher.score_group` scores each finished episode's whole ledger once (every position from the
first sampled token on) and fills `Trajectory.teacher_logprobs` on the sampled tokens (0.0 on the
prompt, template and tool tokens, which are context, never scored). An episode the teacher could not
score (it died, timed out, refused the ids, answered a non-finite logprob) becomes an infrastructure
failure (`fault="infra"`, its error naming the teacher and its log): masked out of the loss, counted
by the run's `InfraMonitor`, never a signal of 0. A teacher the run started that died is not
restarted, so a run stops past `run.max_infra_failure_rate` with that cause (as for a judge).

`check_same_tokenizer` refuses, at validate, a teacher whose tokenizer differs from the policy's
(vocabulary, special tokens, chat template): the teacher scores the student's ids, so the two must
mean the same thing by every id. It imports nothing of the trainer.
"""

from __future__ import annotations

import asyncio
import logging
import math
import secrets
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from agentrl.config import AgentRLConfig, TeacherConfig
from agentrl.errors import AgentRLError, ConfigError
from agentrl.inference.client import HTTPServerClient
from agentrl.inference.launcher import ServerProcess, launch_server
from agentrl.models import resolve_model_path
from agentrl.types import TokenOrigin, Trajectory

__all__ = ["Teacher", "TeacherError", "check_same_tokenizer", "teacher_for_job"]

log = logging.getLogger(__name__)


class TeacherError(AgentRLError):
    """The teacher could not score (it failed to start, died, timed out or refused); the message says why."""


def check_same_tokenizer(student: Any, teacher: Any, *, student_name: str, teacher_name: str) -> None:
    """Raise ConfigError naming both models when `teacher`'s tokenizer differs from `student`'s in its
    vocabulary (every token and its id), its special tokens or its chat template."""
    differences = []
    s_vocab, t_vocab = student.get_vocab(), teacher.get_vocab()
    if s_vocab != t_vocab:
        only_s = sorted(set(s_vocab) - set(t_vocab))[:3]
        only_t = sorted(set(t_vocab) - set(s_vocab))[:3]
        moved = sorted(k for k in set(s_vocab) & set(t_vocab) if s_vocab[k] != t_vocab[k])[:3]
        differences.append(f"vocabulary ({len(s_vocab)} tokens against {len(t_vocab)}; only the policy's: "
                           f"{only_s}, only the teacher's: {only_t}, other ids: {moved})")
    s_special = {k: str(v) for k, v in student.special_tokens_map.items()}
    t_special = {k: str(v) for k, v in teacher.special_tokens_map.items()}
    if s_special != t_special:
        differences.append(f"special tokens ({s_special} against {t_special})")
    if (student.chat_template or "") != (teacher.chat_template or ""):
        differences.append("chat template")
    if differences:
        raise ConfigError(
            f"distill.teacher: the teacher {teacher_name} does not share the policy's tokenizer "
            f"({student_name}): its {'; '.join(differences)} differ. The teacher scores the policy's "
            "token ids, so both must tokenize alike: pick a teacher of the same family and tokenizer "
            "(for example a checkpoint of a run of this model).")


class Teacher:
    """The run's teacher: started on first use (model_path) or reached (url); scores episodes."""

    def __init__(self, config: TeacherConfig) -> None:
        self.model_path: str | None = None
        if config.model_path is not None:
            self.model_path = resolve_model_path(config.model_path)
        self.engine = config.engine if config.model_path is not None else None
        self.startup_timeout_s = config.startup_timeout_s if config.model_path is not None else 0.0
        self.timeout_s = config.timeout_s
        self.url: str | None = config.url.rstrip("/") if config.url is not None else None
        self.server: ServerProcess | None = None
        self._lock = threading.Lock()
        self._closed = False

    def __repr__(self) -> str:
        return f"Teacher({self.describe()})"

    def describe(self) -> str:
        """What the teacher is, for messages: its model and engine (and log), or its URL."""
        if self.model_path is None:
            return f"the distillation teacher at {self.url} (distill.teacher.url)"
        where = f"; its log is {self.server.log_path}" if self.server is not None else ""
        return f"the distillation teacher the run serves ({self.model_path}, engine {self.engine}{where})"

    def start(self) -> str:
        """Start the teacher's server if the run serves it and it is not started (blocks until it
        answers /health); its base URL. Raises TeacherError when it fails to start or was closed."""
        with self._lock:
            if self._closed:
                raise TeacherError(f"{self.describe()} was stopped with the job")
            if self.url is not None and (self.server is None or self.server.alive):
                return self.url
            if self.server is not None:  # it served and died: not restarted (module docstring)
                raise TeacherError(self._death())
            if self.model_path is None or self.engine is None:  # neither url nor model_path: config refuses it
                raise TeacherError("distill.teacher names neither a url nor a model_path")
            log_dir = Path(tempfile.mkdtemp(prefix="agentrl-teacher-"))
            # Its own bearer token: only the run's clients score on it.
            self.server = launch_server(self.engine, self.model_path, log_path=log_dir / "teacher.log", wait=False,
                                        token=secrets.token_urlsafe(32))
            log.info("starting %s", self.describe())
            try:
                self.server.wait_healthy(self.startup_timeout_s)
            except AgentRLError as exc:
                raise TeacherError(f"{self.describe()} did not start: {exc}") from None
            self.url = self.server.url
            return self.url

    def _death(self) -> str:
        server = self.server
        code = server.returncode if server is not None else None
        tail = server.log_tail(10) if server is not None else ""
        return f"{self.describe()} exited (code {code}) and is not restarted; its log ends:\n{tail}"

    def client(self) -> HTTPServerClient:
        """A client of the teacher for the calling event loop (the caller closes it)."""
        url = self.start()
        token = self.server.token if self.server is not None else None
        return HTTPServerClient(url, server_id="teacher", timeout_s=self.timeout_s, token=token)

    async def score_group(self, trajectories: Sequence[Trajectory]) -> None:
        """Fill `teacher_logprobs` of every episode of the group that has sampled tokens and is not
        already masked; an episode the teacher cannot score becomes an infrastructure failure."""
        todo = [t for t in trajectories if t.trainable and t.num_sampled > 0]
        if not todo:
            return
        try:
            client = await asyncio.to_thread(self.client)
        except TeacherError as exc:
            for t in todo:
                _fail(t, str(exc))
            return
        try:
            await asyncio.gather(*(self._score_one(client, t) for t in todo))
        finally:
            await client.aclose()

    async def _score_one(self, client: HTTPServerClient, t: Trajectory) -> None:
        start = t.prompt_length
        try:
            if start < 1:
                raise TeacherError("the episode's first token is a sampled one, which no context predicts")
            answer = await client.score(list(t.token_ids), start=start, session_id=t.episode_id,
                                        timeout_s=self.timeout_s)
            scores = fill_teacher_logprobs(t, start, answer.logprobs)
        except Exception as exc:
            if self.server is not None and not self.server.alive:
                _fail(t, self._death())
            else:
                _fail(t, f"{self.describe()} could not score the episode: {type(exc).__name__}: {exc}")
            return
        t.teacher_logprobs = scores

    async def check(self, probe: Sequence[int], student_tokenizer: Any, student_name: str) -> str:
        """Pre-flight: start the teacher (if the run serves it), check the tokenizer of a teacher given by
        `url` where the model it says it serves is a directory here, and score `probe` (ids of the run's
        own template). What was checked; raises TeacherError or ConfigError."""
        client = await asyncio.to_thread(self.client)
        try:
            note = ""
            if self.model_path is None:
                served = (await client.health()).model
                if Path(served).is_dir():
                    from transformers import AutoTokenizer

                    check_same_tokenizer(student_tokenizer, AutoTokenizer.from_pretrained(served),
                                         student_name=student_name, teacher_name=f"{served} at {self.url}")
                    note = f", tokenizer of {served} checked"
                else:
                    note = (f"; its tokenizer was not checked: it serves '{served}', which is no directory here "
                            "(make sure it tokenizes as the policy does)")
            answer = await client.score(list(probe), start=1, timeout_s=self.timeout_s)
        except ConfigError:
            raise
        except Exception as exc:
            raise TeacherError(f"{self.describe()} could not score a probe of {len(probe)} ids: "
                               f"{type(exc).__name__}: {exc}") from None
        finally:
            await client.aclose()
        bad = [x for x in answer.logprobs if not math.isfinite(x) or x > 1e-6]
        if len(answer.logprobs) != len(probe) - 1 or bad:
            raise TeacherError(f"{self.describe()} answered {len(answer.logprobs)} logprobs for {len(probe) - 1} "
                               f"positions{f', some not finite or above 0: {bad[:3]}' if bad else ''}")
        mean = sum(answer.logprobs) / len(answer.logprobs)
        return f"scored {len(probe) - 1} probe tokens (mean logprob {mean:.3f}){note}"

    def close(self) -> None:
        """Stop the teacher's server if the run started it (also by the lifeline if the run dies)."""
        with self._lock:
            self._closed = True
            if self.server is not None:
                self.server.stop()


def fill_teacher_logprobs(t: Trajectory, start: int, logprobs: Sequence[float]) -> list[float]:
    """The ledger-long `teacher_logprobs` from a score of `t.token_ids[start:]`: the teacher's logprob
    on each sampled token, 0.0 on every other one. Raises TeacherError for a wrong count or a
    logprob that is not finite and <= 0."""
    n = len(t.token_ids)
    if len(logprobs) != n - start:
        raise TeacherError(f"the teacher answered {len(logprobs)} logprobs for {n - start} positions")
    out = [0.0] * n
    sampled = int(TokenOrigin.SAMPLED)
    for i in range(start, n):
        if t.origins[i] == sampled:
            lp = float(logprobs[i - start])
            if not math.isfinite(lp) or lp > 1e-6:
                raise TeacherError(f"the teacher answered logprob {lp} for token {i}; a logprob is finite and <= 0")
            out[i] = min(lp, 0.0)
    return out


def _fail(t: Trajectory, message: str) -> None:
    t.fault = "infra"
    t.error = message
    t.teacher_logprobs = []


def teacher_for_job(config: AgentRLConfig, student_tokenizer: Any, student_name: str) -> Teacher | None:
    """The run's teacher from `config.distill` (None without one), its tokenizer checked against the
    policy's when the run serves it (`model_path`); starts nothing."""
    distill = config.distill
    if distill is None:
        return None
    if config.algorithm.advantage == "gae":
        raise ConfigError("distill with algorithm.advantage=gae: the critic learns the env's returns, while "
                          "distillation's signal is a per-token advantage; use an outcome estimator (grpo, "
                          "dr_grpo, rloo, reinforce_pp_baseline) with distill.")
    if config.algorithm.filter_groups and distill.mode == "advantage":
        raise ConfigError("algorithm.filter_groups with distill.mode=advantage would drop every group whose rewards "
                          "are equal, though the teacher's signal on their tokens does not depend on the reward; "
                          "turn algorithm.filter_groups off, or use distill.mode=mixed.")
    teacher_config = distill.teacher
    try:
        teacher = Teacher(teacher_config)
    except AgentRLError as exc:
        raise ConfigError(f"distill.teacher.model_path: {exc}") from exc
    if teacher.model_path is not None:
        if not Path(teacher.model_path).is_dir():
            raise ConfigError(f"distill.teacher.model_path '{teacher_config.model_path}' is neither a model "
                              "directory nor a built-in model name; give a Hugging Face model directory.")
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(teacher.model_path)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"distill.teacher.model_path '{teacher.model_path}' has no tokenizer that loads: "
                              f"{exc}") from exc
        check_same_tokenizer(student_tokenizer, tokenizer, student_name=student_name,
                             teacher_name=teacher.model_path)
    return teacher
