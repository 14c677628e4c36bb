"""Rewards in verl's contract: `fn(data_source, solution_str, ground_truth, extra_info=None)`.

A reward function gets a dataset row's `data_source`, the model's final text, the row's
`reward_model.ground_truth` (as stored: usually a string) and its `extra_info`, and returns a float
or a dict holding `"score"` plus extra fields, as verl's reward managers accept. Envs that score a
final answer (`retool`, `arithmetic`) take one through their `reward_fn` parameter; without it
they use `compute_score`, which picks the answer format by `data_source` as verl's
`default_compute_score` does:

    data_source                                     the model's final answer is
    openai/gsm8k, gsm8k                             the last `#### 72` (else the last \\boxed{})
    math_dapo, math, math_dapo_reasoning, aime*     the last `Answer: 34` line (else the last \\boxed{})
    lighteval/MATH, DigitalLearningGmbH/MATH-lighteval, HuggingFaceH4/MATH-500, numina_*
                                                    the last \\boxed{...}
    agentrl/arithmetic                              the last \\boxed{...}, else the last number
    anything else (agentrl/retool-synth, ...)       the last \\boxed{...} (logged once per source)

The answer is compared with the ground truth by `answers_match`: exactly as rational numbers when
both are numbers, else symbolically with math-verify. Where verl differs: every built-in scorer
scores 1.0 or 0.0 (verl's DAPO scorer gives -1.0 for a wrong answer; under GRPO's group
normalisation the two train alike), GSM8K compares numbers rather than strings ("72.0" is 72), and
a GSM8K or DAPO/AIME reply without its `####` or `Answer:` marker is read for its last \\boxed{}
answer instead of scoring 0 (agentrl's envs ask for boxed answers in their system prompts, e.g.
retool's code mode, so a model obeying them is not failed for it). A ground truth given as a list
accepts any of its items.

A user function is named in the config (`reward.function`, with `reward.kwargs`; verl's
`custom_reward_function.path`/`.name` and `reward_kwargs`) and resolved by `RewardFunction`, which
raises `ConfigError` naming the key for a missing module, file or function or a signature that
cannot take verl's arguments. Judges, reward models and weighted combinations of sources are built
from the rest of the `reward` section by `agentrl.envs.reward_sources`. `check_ground_truths` is the pre-flight check: each row's ground truth,
written as a correct answer in its source's format, must score 1.0, and an answerless reply must
not. This module does not run episodes, and it never executes model text.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.util
import inspect
import logging
import math
import numbers
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agentrl.envs.answers import answers_match, clean_answer, extract_boxed, final_answer
from agentrl.errors import ConfigError, EnvError

__all__ = [
    "ANSWER_FORMATS",
    "AnswerFormat",
    "RewardFn",
    "RewardFunction",
    "RewardResult",
    "RowProblem",
    "answer_format",
    "check_ground_truths",
    "compute_score",
    "ground_truth_of",
    "render_answer",
    "score_row",
]

log = logging.getLogger(__name__)

RewardFn = Callable[..., Any]
"""A reward function with verl's signature: `(data_source, solution_str, ground_truth, extra_info=None)`
returning a float or a dict with "score"."""

_GSM8K_RE = re.compile(r"####\s*\$?\s*(-?[\d,]*\.?\d+)")
_ANSWER_LINE_RE = re.compile(r"(?i)\banswer\s*:\s*([^\n]+)")
_DEFAULT_FUNCTION_NAME = "compute_score"  # verl's `custom_reward_function.name` default


# ── answer formats ──────────────────────────────────────────────────────────────────────────


@dataclass(frozen=True)
class AnswerFormat:
    """How a family of datasets writes a final answer: how to find it, and how to write one."""

    name: str
    extract: Callable[[str], str | None]
    """The final answer in a reply, or None when the reply gives none in this format."""
    render: Callable[[str], str]
    """A reply that states `answer` in this format (used by the pre-flight check)."""


def _extract_gsm8k(text: str) -> str | None:
    found = _GSM8K_RE.findall(text)
    return found[-1].replace(",", "") if found else None


def _extract_gsm8k_or_boxed(text: str) -> str | None:
    found = _extract_gsm8k(text)
    return found if found is not None else extract_boxed(text)


def _extract_answer_line(text: str) -> str | None:
    found = _ANSWER_LINE_RE.findall(text)
    if found:
        return clean_answer(found[-1])
    return extract_boxed(text)


ANSWER_FORMATS: dict[str, AnswerFormat] = {
    "gsm8k": AnswerFormat("gsm8k", _extract_gsm8k_or_boxed, lambda a: f"The total is {a}.\n#### {a}"),
    "answer_line": AnswerFormat("answer_line", _extract_answer_line, lambda a: f"So it is {a}.\nAnswer: {a}"),
    "boxed": AnswerFormat("boxed", extract_boxed, lambda a: f"The answer is $\\boxed{{{a}}}$."),
    "boxed_or_number": AnswerFormat("boxed_or_number", final_answer, lambda a: f"The result is \\boxed{{{a}}}."),
}
"""The built-in answer formats by name."""

_FORMAT_OF_SOURCE: dict[str, str] = {
    "openai/gsm8k": "gsm8k",
    "gsm8k": "gsm8k",
    "math_dapo": "answer_line",
    "math": "answer_line",
    "math_dapo_reasoning": "answer_line",
    "lighteval/MATH": "boxed",
    "DigitalLearningGmbH/MATH-lighteval": "boxed",
    "HuggingFaceH4/MATH-500": "boxed",
    "agentrl/arithmetic": "boxed_or_number",
    "agentrl/retool-synth": "boxed",
}
_FORMAT_OF_PREFIX: tuple[tuple[str, str], ...] = (("aime", "answer_line"), ("numina_", "boxed"))
_warned_sources: set[str] = set()


def answer_format(data_source: str | None) -> AnswerFormat:
    """The answer format `compute_score` uses for rows of `data_source` (see the module docstring)."""
    source = data_source or ""
    name = _FORMAT_OF_SOURCE.get(source)
    if name is None:
        name = next((f for prefix, f in _FORMAT_OF_PREFIX if source.startswith(prefix)), None)
    if name is None:
        if source not in _warned_sources:
            _warned_sources.add(source)
            log.info("data_source %r has no built-in scorer; its rows are scored on their last \\boxed{} "
                     "answer (name your own with reward.function=module:fn)", source)
        name = "boxed"
    return ANSWER_FORMATS[name]


def ground_truth_of(ground_truth: Any) -> list[str]:
    """The acceptable answers a ground truth stands for (a GSM8K solution text gives its `####` number)."""
    if hasattr(ground_truth, "tolist") and not isinstance(ground_truth, str):
        ground_truth = ground_truth.tolist()  # numpy values, as pandas-read parquet gives them
    items = list(ground_truth) if isinstance(ground_truth, (list, tuple)) else [ground_truth]
    out = []
    for item in items:
        if item is None:
            continue
        text = str(item).strip()
        if "####" in text:
            text = _extract_gsm8k(text) or text
        elif "\\boxed" in text:
            text = extract_boxed(text) or text
        if text:
            out.append(text)
    return out


def compute_score(
    data_source: str | None, solution_str: str, ground_truth: Any, extra_info: Any = None
) -> dict[str, Any]:
    """The default reward: 1.0 when the final answer in `data_source`'s format matches, else 0.0.

    Returns verl's dict form: `{"score", "pred" (the answer found, or None), "format"}`.
    """
    fmt = answer_format(data_source)
    pred = fmt.extract(solution_str)
    ok = pred is not None and any(answers_match(pred, truth) for truth in ground_truth_of(ground_truth))
    return {"score": 1.0 if ok else 0.0, "pred": pred, "format": fmt.name}


def render_answer(data_source: str | None, ground_truth: Any) -> str:
    """A reply stating `ground_truth` (its first acceptable answer) as `data_source`'s format asks."""
    truths = ground_truth_of(ground_truth)
    return answer_format(data_source).render(truths[0] if truths else "")


# ── user functions ──────────────────────────────────────────────────────────────────────────


class RewardFunction:
    """The run's reward function: `reward.function` resolved, `reward.kwargs` bound (see the module).

    `spec` is `package.module:fn`, `path/to/file.py:fn`, or either without `:fn` (then the function
    is `compute_score`, verl's default name); None is the built-in `compute_score`. Resolving
    imports the module (or runs the file) once and checks that the function can be called with
    verl's arguments as keywords plus `kwargs`; every failure is a `ConfigError` naming the key.
    It pickles as its spec, so it can be sent to another process and resolved there again.
    """

    def __init__(self, spec: str | None = None, kwargs: Mapping[str, Any] | None = None) -> None:
        self.spec = spec
        self.kwargs = dict(kwargs or {})
        if spec is None:
            if self.kwargs:
                raise ConfigError(
                    f"reward.kwargs {sorted(self.kwargs)} were given but reward.function is not set; the "
                    "built-in compute_score takes no extra arguments. Name your function "
                    "(reward.function=module:fn) or drop reward.kwargs."
                )
            self.fn: RewardFn = compute_score
            self.name = "agentrl.envs.rewards:compute_score"
        else:
            self.fn = _resolve(spec)
            self.name = spec
            _check_signature(self.fn, spec, self.kwargs)

    def __call__(
        self, data_source: str | None, solution_str: str, ground_truth: Any, extra_info: Any = None
    ) -> Any:
        return self.fn(data_source=data_source, solution_str=solution_str, ground_truth=ground_truth,
                       extra_info=extra_info, **self.kwargs)

    def __reduce__(self) -> tuple[Any, ...]:
        return (RewardFunction, (self.spec, self.kwargs))

    def __repr__(self) -> str:
        return f"RewardFunction({self.name!r}{', ' + repr(self.kwargs) if self.kwargs else ''})"


def _split_spec(spec: str) -> tuple[str, str]:
    target, sep, name = spec.rpartition(":")
    if not sep or "/" in name or "\\" in name or name.endswith(".py"):
        return spec, _DEFAULT_FUNCTION_NAME  # no function named: verl's default name
    return target, name


def _is_file(target: str) -> bool:
    return target.endswith(".py") or "/" in target or "\\" in target


@functools.lru_cache(maxsize=32)
def _load_file(path: str) -> Any:
    """Run a Python file as a module (once per path); it is registered under a unique name."""
    module_name = "agentrl_reward_" + hashlib.sha1(path.encode()).hexdigest()[:12]
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise ConfigError(f"reward.function: '{path}' cannot be loaded as a Python file; name a .py file.")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[module_name]
        raise ConfigError(f"reward.function: running '{path}' failed: {type(exc).__name__}: {exc}") from exc
    return module


def _resolve(spec: str) -> RewardFn:
    spec = spec.strip()
    target, name = _split_spec(spec)
    if not target or not name:
        raise ConfigError(
            f"reward.function '{spec}' must look like 'package.module:function' or 'path/to/file.py:function'."
        )
    if _is_file(target):
        path = Path(target).expanduser()
        if not path.is_file():
            raise ConfigError(
                f"reward.function: the file '{target}' does not exist (relative paths are read from the "
                f"current directory, {Path.cwd()}); give the path of a .py file."
            )
        module = _load_file(str(path.resolve()))
        where = f"the file '{target}'"
    else:
        try:
            module = importlib.import_module(target)
        except ModuleNotFoundError as exc:
            if exc.name and target.startswith(exc.name):
                raise ConfigError(
                    f"reward.function: no module named '{target}' can be imported; install it, add its folder "
                    "to PYTHONPATH, or give a file path (reward.function=path/to/file.py:fn)."
                ) from exc
            raise ConfigError(f"reward.function: importing '{target}' failed: {exc}") from exc
        except Exception as exc:
            raise ConfigError(f"reward.function: importing '{target}' failed: {type(exc).__name__}: {exc}") from exc
        where = f"the module '{target}'"
    fn = getattr(module, name, None)
    if fn is None:
        public = sorted(n for n, v in vars(module).items()
                        if callable(v) and not isinstance(v, type) and not n.startswith("_"))
        shown = ", ".join(public[:10]) or "none"
        raise ConfigError(
            f"reward.function: {where} has no function '{name}' (its functions: {shown}); "
            f"name one as '{target}:function'."
        )
    if not callable(fn):
        raise ConfigError(f"reward.function: '{spec}' is a {type(fn).__name__}, not a function.")
    function: Callable[..., Any] = fn
    return function


def _check_signature(fn: RewardFn, spec: str, kwargs: dict[str, Any]) -> None:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # a builtin or C function whose signature is hidden: it is checked when it runs
    try:
        sig.bind(data_source="s", solution_str="t", ground_truth="g", extra_info=None, **kwargs)
    except TypeError as exc:
        extra = f" plus reward.kwargs {sorted(kwargs)}" if kwargs else ""
        raise ConfigError(
            f"reward.function '{spec}' has the signature {sig}, which cannot take verl's keyword arguments "
            f"(data_source, solution_str, ground_truth, extra_info){extra}: {exc}. Define it as "
            "`def fn(data_source, solution_str, ground_truth, extra_info=None, **kwargs) -> float | dict`."
        ) from exc


# ── scoring a row ───────────────────────────────────────────────────────────────────────────


@dataclass(frozen=True)
class RewardResult:
    """A reward function's answer: the score, and the extra fields of a dict result."""

    score: float
    extra: dict[str, Any] = field(default_factory=dict)
    record: dict[str, Any] = field(default_factory=dict)
    """How a combined reward was made (each source's score; a judge's request and verdict), for the
    trajectory's `info["reward"]`; empty for a rule function alone (`agentrl.envs.reward_sources`)."""

    def metrics(self) -> dict[str, float]:
        """The numeric extra fields, as `reward/<name>` episode metrics."""
        return {f"reward/{k}": float(v) for k, v in self.extra.items()
                if isinstance(v, numbers.Real) and math.isfinite(float(v))}


def _as_result(value: Any, name: str) -> RewardResult:
    if isinstance(value, Mapping):
        if "score" not in value:
            raise ConfigError(
                f"reward function {name} returned a dict without 'score' (keys: {sorted(value)}); "
                "return a float, or a dict with 'score' and any extra fields."
            )
        score, extra = value["score"], {k: v for k, v in value.items() if k != "score"}
    else:
        score, extra = value, {}
    if not isinstance(score, numbers.Real) or not math.isfinite(float(score)):
        raise ConfigError(
            f"reward function {name} returned {score!r} as the score; it must be a finite number."
        )
    return RewardResult(float(score), extra)


def score_row(
    reward_fn: RewardFn, row: Mapping[str, Any], solution_str: str, *, default_data_source: str | None = None
) -> RewardResult:
    """Score `solution_str` against dataset `row` with `reward_fn`.

    The envs pass the episode's final assistant turn as `solution_str` (the turn that gives the
    answer; verl's single-turn reward sees the whole response, which is that turn there).

    `default_data_source` stands in for a row without `data_source` (an env's own task family).
    Raises `EnvError` when the row has no `reward_model.ground_truth` (nothing to measure against:
    the episode must not be scored 0), and `ConfigError` when the function returns something that
    is not a finite score.
    """
    truth = (row.get("reward_model") or {}).get("ground_truth")
    if truth is None or (isinstance(truth, str) and not truth.strip()):
        raise EnvError(
            "The dataset row has no reward_model.ground_truth to score the answer against; add one "
            "(verl's format: {'reward_model': {'style': 'rule', 'ground_truth': '42'}})."
        )
    extra_info = row.get("extra_info")
    value = reward_fn(
        data_source=row.get("data_source") or default_data_source, solution_str=solution_str, ground_truth=truth,
        extra_info=dict(extra_info) if isinstance(extra_info, Mapping) else extra_info,
    )
    return _as_result(value, getattr(reward_fn, "name", None) or repr(reward_fn))


# ── the pre-flight check ────────────────────────────────────────────────────────────────────


_NO_ANSWER = "I could not work this out."


class RowProblem(str):
    """One line of `check_ground_truths`: the message, and its `kind` for callers that weigh kinds:
    "no_truth", "raised", "below_full" (a row's own answer scored below 1.0), "blind" (a reply with no
    answer scored 1.0)."""

    kind: str

    def __new__(cls, message: str, kind: str) -> RowProblem:
        line = super().__new__(cls, message)
        line.kind = kind
        return line


def check_ground_truths(
    reward_fn: RewardFn,
    rows: Sequence[Mapping[str, Any]],
    *,
    where: Sequence[str] | None = None,
    render: Callable[[str | None, Any], str] = render_answer,
) -> list[RowProblem]:
    """What is wrong with scoring `rows` with `reward_fn`, one line per row (empty: all good).

    Each row's ground truth, written as a correct reply by `render(data_source, ground_truth)` (by
    default in the format `compute_score` expects for that source), must score 1.0; a reply with no
    answer at all must score below 1.0 (checked once per data source), else the function is not
    looking at the answer. A function that raises or returns something other than a finite score is
    reported too. `where[i]` names row i in the lines (e.g. "train.jsonl row 3"; default "row i").
    A broken reward function or a dataset whose answers are keyed wrong is found this way before
    any training.
    """
    problems: list[RowProblem] = []
    name = getattr(reward_fn, "name", None) or getattr(reward_fn, "__name__", None) or repr(reward_fn)
    checked_sources: set[Any] = set()
    for i, row in enumerate(rows):
        label = where[i] if where is not None else f"row {i}"
        truth = (row.get("reward_model") or {}).get("ground_truth")
        source = row.get("data_source")
        if truth is None or (isinstance(truth, str) and not truth.strip()):
            problems.append(RowProblem(f"{label}: no reward_model.ground_truth to score against", "no_truth"))
            continue
        reply = render(source, truth)
        try:
            result = score_row(reward_fn, row, reply)
        except Exception as exc:  # the point of the check: report any failure, per row
            problems.append(RowProblem(f"{label}: {name} raised {type(exc).__name__}: {exc}", "raised"))
            continue
        if result.score < 1.0 - 1e-9:
            problems.append(RowProblem(
                f"{label}: the correct answer {reply!r} (data_source {source!r}, ground truth {truth!r}) "
                f"scored {result.score:g}, not 1.0", "below_full"))
        if source not in checked_sources:
            checked_sources.add(source)
            try:
                blank = score_row(reward_fn, row, _NO_ANSWER)
            except Exception as exc:
                problems.append(RowProblem(
                    f"{label}: {name} raised {type(exc).__name__} on a reply with no answer: {exc}", "raised"))
                continue
            if blank.score >= 1.0 - 1e-9:
                problems.append(RowProblem(
                    f"{label}: a reply with no answer ({_NO_ANSWER!r}) scored {blank.score:g}; the reward "
                    f"function {name} does not look at the answer", "blind"))
    return problems
