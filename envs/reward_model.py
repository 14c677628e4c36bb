"""`RewardModelScorer`: a Hugging Face sequence-classification reward model, scored in a process of its own.

The reward of an answer is the first logit of `AutoModelForSequenceClassification` (num_labels=1, as
trained reward models are: a raw, unbounded score) on the conversation: the row's prompt messages
plus the answer as the assistant's turn, rendered with the reward model's chat template (its
tokenizer's; without one, the messages' contents joined by blank lines). A conversation longer than
`reward.model.max_length` tokens is a missing reward with cause `truncated`, never cut and scored.

The model runs in a child process (`python -m agentrl.inference.reward_model_server`, an
`agentrl.child_process.ChildProcess`: under a lifeline, so it dies with the process that started
it; its stderr is kept for the error that says why it died), started on the first request and answering
JSON lines on its stdin/stdout one request at a time; torch is imported there only, so this module
stays torch-free. A process that fails to start within `startup_timeout_s` or answers nothing within
`timeout_s` gives a missing reward (`infra`, `timeout`), which masks the episode. One that died is
not restarted: every later reward is missing (`infra`, naming its exit code), so the run stops past
`run.max_infra_failure_rate` with the cause instead of training on a reward model that comes and
goes. The scorer pickles as its config; each process that scores starts its own child.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import itertools
import json
import logging
import sys
import threading
from collections.abc import Mapping
from typing import Any

from agentrl.child_process import ChildProcess
from agentrl.config import RewardModelConfig
from agentrl.errors import RewardMissingError

__all__ = ["RewardModelScorer", "conversation_of"]

log = logging.getLogger(__name__)


def conversation_of(row: Mapping[str, Any], answer: str) -> list[dict[str, str]]:
    """The messages the reward model scores: the row's prompt, then `answer` as the assistant's turn."""
    prompt = row.get("prompt")
    if isinstance(prompt, str):
        messages = [{"role": "user", "content": prompt}]
    else:
        messages = [{"role": str(m.get("role", "user")), "content": str(m.get("content") or "")}
                    for m in (prompt or []) if isinstance(m, Mapping)]
    return [*messages, {"role": "assistant", "content": answer}]


class RewardModelScorer:
    """The reward model of `reward.model` (see the module docstring); `await scorer.ascore(row, answer)`."""

    def __init__(self, config: RewardModelConfig) -> None:
        self.config = config
        self.path = config.path
        self.max_length = config.max_length
        self.timeout_s = config.timeout_s
        self.startup_timeout_s = config.startup_timeout_s
        self._proc: ChildProcess | None = None
        self._pending: dict[int, concurrent.futures.Future[dict[str, Any]]] = {}
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._ready: concurrent.futures.Future[dict[str, Any]] | None = None
        self._dead: str | None = None

    def __reduce__(self) -> tuple[Any, ...]:
        return (RewardModelScorer, (self.config,))

    def __repr__(self) -> str:
        return f"RewardModelScorer({self.path!r})"

    # ── the child process ───────────────────────────────────────────────────────────────────
    def _start(self) -> concurrent.futures.Future[dict[str, Any]]:
        with self._lock:
            if self._ready is not None:  # started once: a process that died stays dead (see the module)
                return self._ready
            command = [sys.executable, "-m", "agentrl.inference.reward_model_server", "--path", self.path,
                       "--max-length", str(self.max_length)]
            self._ready = concurrent.futures.Future()
            # its stdout answers requests; its stderr goes to a log whose tail says why it died
            self._proc = ChildProcess(command, name=f"the reward model process for {self.path}", stdin=True,
                                      stdout=True, text=True).start()
            threading.Thread(target=self._read, args=(self._proc, self._ready), daemon=True,
                             name="reward-model-reader").start()
            atexit.register(self.close)
            return self._ready

    def _read(self, proc: ChildProcess, ready: concurrent.futures.Future[dict[str, Any]]) -> None:
        assert proc.stdout is not None  # opened as a pipe above
        for line in proc.stdout:
            try:
                message = json.loads(line)
            except json.JSONDecodeError:
                log.info("reward model process: %s", line.rstrip())
                continue
            if "ready" in message:
                if not ready.done():
                    ready.set_result(message)
                continue
            future = self._pending.pop(int(message.get("id", -1)), None)
            if future is not None and not future.done():
                future.set_result(message)
        proc.wait()
        with self._lock:
            self._dead = str(proc.failure(proc.exit_cause() or "ended"))
            pending, self._pending = self._pending, {}
        error = RuntimeError(self._dead)
        if not ready.done():
            ready.set_exception(error)
        for future in pending.values():
            if not future.done():
                future.set_exception(error)

    def close(self) -> None:
        """Stop the child process (it also dies with this process, by its lifeline)."""
        proc, self._proc = self._proc, None
        if proc is not None:
            proc.stop(grace_s=10.0)

    # ── scoring ─────────────────────────────────────────────────────────────────────────────
    async def ascore(self, row: Mapping[str, Any], answer: str) -> tuple[float, dict[str, Any]]:
        """The reward model's score of `answer` to `row` and a record of it; raises `RewardMissingError`."""
        record: dict[str, Any] = {"path": self.path}
        where = f"the reward model {self.path}"
        try:
            async with asyncio.timeout(self.startup_timeout_s):
                await asyncio.wrap_future(self._start())
        except TimeoutError:
            raise RewardMissingError("timeout", f"{where} did not load within reward.model.startup_timeout_s="
                                     f"{self.startup_timeout_s:g} s", record) from None
        except RuntimeError as exc:
            raise RewardMissingError("infra", f"{where} could not start: {exc} (check reward.model.path)",
                                     record) from None
        request_id = next(self._ids)
        future: concurrent.futures.Future[dict[str, Any]] = concurrent.futures.Future()
        with self._lock:
            proc = self._proc
            if self._dead is not None or proc is None or proc.stdin is None:
                raise RewardMissingError("infra", f"{where}: {self._dead or 'the process is not running'}", record)
            self._pending[request_id] = future
            try:
                proc.stdin.write(json.dumps({"id": request_id, "messages": conversation_of(row, answer)}) + "\n")
                proc.stdin.flush()
            except (OSError, ValueError) as exc:  # a pipe broken, or closed by `close`
                self._pending.pop(request_id, None)
                raise RewardMissingError("infra", f"{where}: the process stopped taking requests ({exc})",
                                         record) from None
        try:
            async with asyncio.timeout(self.timeout_s):
                answer_msg = await asyncio.wrap_future(future)
        except TimeoutError:
            self._pending.pop(request_id, None)
            raise RewardMissingError("timeout", f"{where} did not score within reward.model.timeout_s="
                                     f"{self.timeout_s:g} s", record) from None
        except RuntimeError as exc:
            raise RewardMissingError("infra", f"{where}: {exc}", record) from None
        if "error" in answer_msg:
            cause = answer_msg.get("cause", "infra")
            raise RewardMissingError(cause if cause in RewardMissingError.CAUSES else "infra",
                                     f"{where}: {answer_msg['error']}", record)
        record["tokens"] = answer_msg.get("tokens")
        return float(answer_msg["score"]), record
