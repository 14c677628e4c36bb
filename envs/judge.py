"""`JudgeReward`: an LLM judge that scores a final answer with a rubric, over an OpenAI-compatible API.

The judge gets one user message, the rubric (`reward.judge.prompt`, a template with `{question}`,
`{answer}` and `{ground_truth}`; by default `DEFAULT_RUBRIC`), and answers with a verdict that is
read with a declared schema: by default the last JSON object of the reply, validated as
`{"score": float in [0, 1], "reason": str}`; with `reward.judge.verdict_regex` the number its group
`score` (or first group) matched. Requests go to `reward.judge.url` (`POST {url}/chat/completions`,
the bearer key from the environment variable `reward.judge.api_key_env`), at most
`max_concurrency` at once per process, each within `timeout_s` (the wait for a slot included).

A verdict that cannot be had is a missing reward with its cause (`RewardMissingError`), never a
score of 0: `infra` (the server cannot be reached, or answered an HTTP error), `timeout` (no answer
within `timeout_s`), `parse` (the reply holds no verdict the schema accepts) or `truncated` (the
reply was cut at `max_tokens` before a readable verdict). Every outcome carries a record of what
was asked and answered (url, model, the rubric as sent, the reply, the verdict), which the envs keep
in the trajectory's `info["reward"]`. The question is the last user message of the row's prompt.

With `reward.judge.model_path` instead of `url`, the run serves the judge model itself: a separate
`agentrl gateway` of it, started on the first judge request of the process (`judge_server.py`); each
request is a session of its own there, ended once answered. A judge server that does not start
within `startup_timeout_s` makes the rewards missing with cause `timeout`; one that failed or died
makes them `infra`, naming its exit code and log. The server is the job's when the job made it
(`JudgeReward(config, server=...)`: the job closes it, `judge_server_of`), else the judge's own
(`stop` ends it). The HTTP client is made per event loop, lazily, so the object pickles as its config
and works in any process (each process serves its own judge).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import re
import weakref
from collections.abc import Mapping
from typing import Any

import httpx

from agentrl.config import JudgeConfig
from agentrl.envs.judge_server import JudgeServer, JudgeServerError
from agentrl.envs.rewards import ground_truth_of
from agentrl.errors import ConfigError, RewardMissingError

__all__ = ["DEFAULT_RUBRIC", "JudgeReward", "judge_server_of", "parse_verdict", "question_of"]

log = logging.getLogger(__name__)

DEFAULT_RUBRIC = (
    "You are grading a student's answer to a question against the reference answer.\n\n"
    "Question:\n{question}\n\nReference answer:\n{ground_truth}\n\nStudent's answer:\n{answer}\n\n"
    "Is the student's final answer equivalent to the reference answer? Reply with only a JSON object "
    'on one line: {{"score": 1.0 if it is correct else 0.0 (partial credit in between), '
    '"reason": "one short sentence"}}'
)
"""The built-in rubric: correctness against the ground truth, as a JSON verdict."""

_JSON_OBJECT_RE = re.compile(r"\{[^{}]*\}", re.S)


def question_of(row: Mapping[str, Any]) -> str:
    """The question of a verl-format row: its prompt's last user message (or the prompt string)."""
    prompt = row.get("prompt")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, (list, tuple)):
        users = [m.get("content") for m in prompt if isinstance(m, Mapping) and m.get("role") == "user"]
        if users and isinstance(users[-1], str):
            return users[-1]
    return ""


def parse_verdict(reply: str, verdict_regex: str | None = None) -> dict[str, Any]:
    """The verdict in a judge's `reply`: `{"score": float, "reason": str}`; raises ValueError saying
    what is wrong when the reply holds none the schema accepts (see the module docstring)."""
    if verdict_regex is not None:
        found = list(re.finditer(verdict_regex, reply))
        if not found:
            raise ValueError(f"the reply does not match reward.judge.verdict_regex {verdict_regex!r}")
        match = found[-1]
        text = match.group("score") if "score" in match.re.groupindex else (
            match.group(1) if match.re.groups else match.group(0))
        try:
            score = float(text)
        except (TypeError, ValueError):
            raise ValueError(f"the verdict_regex matched {text!r}, which is not a number") from None
        return {"score": _in_unit_range(score), "reason": ""}
    for candidate in reversed(_JSON_OBJECT_RE.findall(reply)):
        try:
            value = json.loads(candidate)
        except json.JSONDecodeError:
            continue
        if isinstance(value, dict) and "score" in value:
            score = value["score"]
            if isinstance(score, bool) or not isinstance(score, (int, float)):
                raise ValueError(f"the verdict's score is {score!r}, not a number")
            reason = value.get("reason", "")
            if not isinstance(reason, str):
                raise ValueError(f"the verdict's reason is a {type(reason).__name__}, not a string")
            return {"score": _in_unit_range(float(score)), "reason": reason}
    raise ValueError('the reply holds no JSON object with a "score" ({"score": <0..1>, "reason": "..."})')


def _in_unit_range(score: float) -> float:
    if not math.isfinite(score) or not 0.0 <= score <= 1.0:
        raise ValueError(f"the verdict's score {score!r} is not in [0, 1]")
    return score


class JudgeReward:
    """The judge of `reward.judge` (see the module docstring); `await judge.ascore(row, answer)`."""

    def __init__(self, config: JudgeConfig, *, server: JudgeServer | None = None) -> None:
        """`server`: the judge server of `config.model_path` that its owner (the job) made and closes;
        without it the judge makes its own (a judge unpickled in another process too), which `stop` ends."""
        self.config = config
        self._owns_server = server is None
        self.server = server if server is not None else judge_server_of(config)
        self.url = config.url.rstrip("/") if config.url is not None else f"(the judge {config.model_path}, served by the run)"
        self.model = config.model
        self.rubric = config.prompt if config.prompt is not None else DEFAULT_RUBRIC
        try:
            self.rubric.format(question="q", answer="a", ground_truth="g")
        except (KeyError, IndexError, ValueError) as exc:
            raise ConfigError(
                f"reward.judge.prompt is not a usable template ({type(exc).__name__}: {exc}); it may use "
                "{question}, {answer} and {ground_truth}, and must write literal braces as {{ and }}."
            ) from exc
        if config.verdict_regex is not None:
            try:
                re.compile(config.verdict_regex)
            except re.error as exc:
                raise ConfigError(f"reward.judge.verdict_regex is not a regular expression: {exc}") from exc
        self.verdict_regex = config.verdict_regex
        self.headers = {"Content-Type": "application/json"}
        if config.api_key_env is not None:
            key = os.environ.get(config.api_key_env)
            if not key:
                raise ConfigError(
                    f"reward.judge.api_key_env names ${config.api_key_env}, which is not set in this "
                    "environment; export it (the judge's API key) or unset reward.judge.api_key_env."
                )
            self.headers["Authorization"] = f"Bearer {key}"
        self.timeout_s = config.timeout_s
        self.max_concurrency = config.max_concurrency
        self.max_tokens = config.max_tokens
        self.temperature = config.temperature
        self._per_loop: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop,
                                                  tuple[httpx.AsyncClient, asyncio.Semaphore]] = (
            weakref.WeakKeyDictionary())

    def __reduce__(self) -> tuple[Any, ...]:
        return (JudgeReward, (self.config,))

    def __repr__(self) -> str:
        return f"JudgeReward({self.url!r}, model={self.model!r})"

    def _client(self) -> tuple[httpx.AsyncClient, asyncio.Semaphore]:
        loop = asyncio.get_running_loop()
        held = self._per_loop.get(loop)
        if held is None or held[0].is_closed:
            client = httpx.AsyncClient(headers=self.headers, timeout=httpx.Timeout(self.timeout_s),
                                       limits=httpx.Limits(max_connections=self.max_concurrency))
            held = self._per_loop[loop] = (client, asyncio.Semaphore(self.max_concurrency))
        return held

    async def aclose(self) -> None:
        """Close the HTTP client of the running event loop (the others close with their loops). A judge
        server the run serves keeps running: `stop` ends it."""
        held = self._per_loop.pop(asyncio.get_running_loop(), None)
        if held is not None:
            await held[0].aclose()

    def stop(self) -> None:
        """Stop the judge server this judge made (`model_path`), if any; it also dies with the process. A
        server its owner gave it (`server=`) is the owner's to close."""
        if self.server is not None and self._owns_server:
            self.server.close()

    async def _served_url(self, record: dict[str, Any]) -> tuple[str, str | None]:
        """(the `/v1` URL this request goes to, the gateway's base URL when the run serves the judge)."""
        if self.server is None:
            return self.url, None
        where = f"the reward judge the run serves ({self.server.model_path})"
        try:
            url, base = await self.server.session_url()
        except TimeoutError:
            raise RewardMissingError("timeout", f"{where} did not start within reward.judge.startup_timeout_s="
                                     f"{self.server.startup_timeout_s:g} s; its log: {self.server.log_path}",
                                     record) from None
        except JudgeServerError as exc:
            raise RewardMissingError("infra", f"{where}: {exc}", record) from None
        record["url"] = url
        return url, base

    async def ascore(self, row: Mapping[str, Any], answer: str) -> tuple[float, dict[str, Any]]:
        """The judge's score of `answer` to `row` and the record of the exchange; raises
        `RewardMissingError` (with the record) when no verdict can be had."""
        truth_text = " or ".join(ground_truth_of((row.get("reward_model") or {}).get("ground_truth")))
        content = self.rubric.format(question=question_of(row), answer=answer, ground_truth=truth_text)
        body = {"model": self.model, "messages": [{"role": "user", "content": content}],
                "max_tokens": self.max_tokens, "temperature": self.temperature}
        record: dict[str, Any] = {"url": self.url, "model": self.model, "request": content}
        url, served_base = await self._served_url(record)
        client, slots = self._client()
        try:
            return await self._ask(client, slots, url, body, record)
        finally:
            if served_base is not None:  # the session's exchange goes to the judge's trajectories.jsonl
                key = url.rstrip("/").split("/")[-2]
                with contextlib.suppress(httpx.HTTPError):
                    await client.post(f"{served_base}/agentrl/sessions/{key}/end", json={}, timeout=10.0)

    async def _ask(self, client: httpx.AsyncClient, slots: asyncio.Semaphore, url: str, body: dict[str, Any],
                   record: dict[str, Any]) -> tuple[float, dict[str, Any]]:
        where = (f"the reward judge at {url}" if self.server is None else
                 f"the reward judge the run serves ({self.server.model_path}) at {url}")
        try:
            async with asyncio.timeout(self.timeout_s):
                async with slots:
                    response = await client.post(f"{url}/chat/completions", json=body)
        except (TimeoutError, httpx.TimeoutException):
            raise RewardMissingError("timeout", f"{where} did not answer within reward.judge.timeout_s="
                                     f"{self.timeout_s:g} s (raise it, or lower reward.judge.max_concurrency)",
                                     record) from None
        except httpx.HTTPError as exc:
            fix = (self.server.failure if self.server is not None else None) or (
                "start the judge server or fix reward.judge.url" if self.server is None else
                "the judge server the run serves stopped answering")
            raise RewardMissingError("infra", f"{where} cannot be reached ({type(exc).__name__}: {exc}); {fix}",
                                     record) from None
        if response.status_code >= 400:
            record["reply"] = response.text[:2000]
            raise RewardMissingError("infra", f"{where} answered HTTP {response.status_code}: "
                                     f"{_one_line(response.text)[:300]} (check reward.judge.model and the key "
                                     "in reward.judge.api_key_env)", record)
        try:
            choice = response.json()["choices"][0]
            reply = choice["message"]["content"] or ""
            finish = choice.get("finish_reason")
        except (ValueError, KeyError, IndexError, TypeError):
            record["reply"] = response.text[:2000]
            raise RewardMissingError("parse", f"{where} did not answer in the chat-completions format "
                                     f"({_one_line(response.text)[:200]!r}); point reward.judge.url at an "
                                     "OpenAI-compatible /v1 base URL", record) from None
        record["reply"] = reply
        record["finish_reason"] = finish
        try:
            verdict = parse_verdict(reply, self.verdict_regex)
        except ValueError as exc:
            if finish == "length":
                raise RewardMissingError("truncated", f"{where} was cut at reward.judge.max_tokens="
                                         f"{self.max_tokens} before a readable verdict ({exc}); raise it",
                                         record) from None
            raise RewardMissingError("parse", f"{where} gave no readable verdict: {exc}; reply "
                                     f"{_one_line(reply)[:200]!r}", record) from None
        record["verdict"] = verdict
        return verdict["score"], record


def judge_server_of(config: JudgeConfig) -> JudgeServer | None:
    """The judge server `config` needs (`model_path` given), made, not started; None for a judge at a URL."""
    if config.model_path is None:
        return None
    return JudgeServer(config.model_path, config.engine, config.server_args, config.startup_timeout_s)


def _one_line(text: str) -> str:
    return " ".join(text.split())
