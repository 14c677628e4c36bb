"""Final-answer extraction and checking, shared by the math environments.

`extract_boxed` finds the last `\\boxed{...}` (braces matched, so `\\boxed{\\frac{1}{2}}` works);
`final_answer` falls back to the last number in the text. `answers_match` compares a given answer
with the ground truth: exactly as rational numbers when both parse as numbers (`1,234`, `0.5`,
`3/4`, `\\frac{3}{4}`), else with `math-verify` (symbolic equivalence) when it is installed, else by
normalised string equality. `clean_answer` strips the wrapping a model puts around an answer (`$`,
`\\boxed{}`, `\\text{}`, a trailing full stop). It never evaluates model text as code.

math-verify bounds its own time with `signal.alarm`, which only works in the main thread; elsewhere
(a worker thread, a Ray actor's event loop) it is called without that alarm, so an answer is never
scored wrong merely because it was checked off the main thread. Answers are at most 300 characters,
which bounds the work either way.
"""

from __future__ import annotations

import re
import threading
from fractions import Fraction

__all__ = ["answers_match", "clean_answer", "extract_boxed", "final_answer", "parse_number"]

_NUMBER_RE = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
_FRAC_RE = re.compile(r"^\\[dt]?frac\{(-?[\d.]+)\}\{(-?[\d.]+)\}$")
_MAX_ANSWER_CHARS = 300


def extract_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` (or `\\fbox{...}`) in `text`, braces matched."""
    best = None
    for m in re.finditer(r"\\(?:boxed|fbox)\s*\{", text):
        depth, i = 1, m.end()
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth == 0:
            best = text[m.end() : i - 1].strip()
    return best


def final_answer(text: str) -> str | None:
    """The boxed answer if there is one, else the last number in the text, else None."""
    boxed = extract_boxed(text)
    if boxed is not None:
        return boxed
    numbers = _NUMBER_RE.findall(text)
    return numbers[-1] if numbers else None


def clean_answer(text: str) -> str:
    """`text` without the wrapping around an answer: `$...$`, `\\boxed{}`, `\\text{}`, a final `.`."""
    s = text.strip()
    boxed = extract_boxed(s)
    if boxed is not None:
        s = boxed
    s = s.strip().rstrip(".").strip()
    if len(s) >= 2 and s.startswith("$") and s.endswith("$"):
        s = s.strip("$").strip()
    m = re.fullmatch(r"\\(?:text|textbf|mathrm)\{(.*)\}", s)
    return m.group(1).strip() if m else s


def parse_number(text: str) -> Fraction | None:
    """`text` as an exact rational number, or None (commas, `$`, `\\frac`, `a/b` understood)."""
    s = text.strip().strip("$").replace(",", "").replace("\\!", "").replace(" ", "")
    s = re.sub(r"^\\text\{(.*)\}$", r"\1", s)
    m = _FRAC_RE.match(s)
    if m:
        s = f"{m.group(1)}/{m.group(2)}"
    if not s or len(s) > 60:
        return None
    try:
        return Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None


def answers_match(given: str | None, truth: str) -> bool:
    """True when `given` is the same answer as `truth` (see the module docstring)."""
    if given is None or len(given) > _MAX_ANSWER_CHARS:
        return False
    a, b = parse_number(given), parse_number(truth)
    if a is not None and b is not None:
        return a == b
    try:
        from math_verify import parse, verify
    except ImportError:
        return _normalise(given) == _normalise(truth)
    # signal.alarm (math-verify's own timeout) exists only in the main thread; see the module docstring.
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    try:
        gold = parse(f"${truth}$", parsing_timeout=timeout)
        pred = parse(f"${given}$", parsing_timeout=timeout)
        return bool(verify(gold, pred, timeout_seconds=timeout))
    except Exception:  # math-verify can fail on odd input; that is a wrong answer, not a crash
        return False


def _normalise(s: str) -> str:
    return re.sub(r"\s+|\\left|\\right|\$", "", s).lower()
