"""`check_env`: does an environment keep the agentrl Env contract?

It runs a fresh environment through the contract of DESIGN.md §4 and reports every violation at
once in one `EnvContractError`: the spaces, `step` before `reset`, the `reset` and `step` return
shapes (chat messages, tool schemas, a finite float reward, bool flags, an info dict), seeded
determinism of `reset` and of `step`, agreement of the async twins with the sync methods,
closing twice, and that an env declaring `requires_ground_truth` gets rows that carry one (the
`options` row, or the row `generate_row` makes). It also runs gymnasium's own `check_env`, whose warnings count as violations,
for environments that can reset without a dataset row (gymnasium's checker passes no options).
It does not judge whether an environment is a good task, only whether it keeps the contract.
"""

from __future__ import annotations

import asyncio
import copy
import gc
import math
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import gymnasium
from gymnasium.utils.env_checker import check_env as gymnasium_check_env

from agentrl.datasets import ground_truth_problem
from agentrl.envs.core import ActionSpace, ChatSpace, Env
from agentrl.errors import EnvContractError, EnvError
from agentrl.types import Action

__all__ = ["check_env"]


def check_env(
    env: Env,
    *,
    actions: Sequence[Action] | None = None,
    seed: int = 0,
    options: dict[str, Any] | None = None,
    skip_gymnasium: bool = False,
) -> None:
    """Check `env` (freshly constructed) against the Env contract; raise listing every violation.

    `actions` are the assistant turns to step with (default: one sample of the action space);
    give turns that call the env's tools to exercise them. `options` is passed to every `reset`
    (for example `{"row": row}` for an env that needs a dataset row).
    """
    problems: list[str] = []
    check = _Recorder(problems)
    if not isinstance(env, gymnasium.Env):
        raise EnvContractError(f"{type(env).__name__} is not a gymnasium.Env; subclass agentrl.Env.")
    check(isinstance(env.observation_space, ChatSpace) or isinstance(env.observation_space, gymnasium.Space),
          "observation_space must be a gymnasium Space (agentrl.envs.ChatSpace for chat messages)")
    check(isinstance(env.action_space, (ActionSpace, gymnasium.Space)),
          "action_space must be a gymnasium Space (agentrl.envs.ActionSpace)")
    if actions is None:
        env.action_space.seed(seed)
        actions = [env.action_space.sample()]
    if not actions:
        raise ValueError("check_env needs at least one action to step with.")
    _check_ground_truth(check, env, options, seed)

    # step before reset must fail loudly, not silently start an episode
    try:
        env.step(actions[0])
    except EnvError:
        pass
    except Exception as exc:  # any other exception is still a refusal, but not the documented one
        problems.append(f"step before reset raised {type(exc).__name__} ({exc}); it should raise EnvError")
    else:
        problems.append("step before reset did not raise; it should raise agentrl.errors.EnvError")

    first = _guard(check, "reset", lambda: env.reset(seed=seed, options=_copy(options)))
    if first is not None:
        _check_reset(check, env, first)
        trace1 = _guard(check, "step", lambda: _rollout(env, actions))
        again = _guard(check, "reset", lambda: env.reset(seed=seed, options=_copy(options)))
        if again is not None:
            check(_same(first[0], again[0]), "reset(seed=s) twice gave different observations")
            trace2 = _guard(check, "step", lambda: _rollout(env, actions))
            if trace1 is not None and trace2 is not None:
                check(_same(trace1, trace2),
                      "the same seed and actions gave different step results (step is not deterministic)")
                for i, result in enumerate(trace1):
                    _check_step(check, env, result, i)
        env_closed_ok = _guard(check, "close", env.close) is not None or True
        check(env_closed_ok, "close failed")
        _guard(check, "second close", env.close)

        async def twins() -> tuple[Any, Any]:
            a = await env.areset(seed=seed, options=_copy(options))
            trace = []
            for action in actions:
                out = await env.astep(action)
                trace.append(out[:4])
                if out[2] or out[3]:
                    break
            await env.aclose()
            await env.aclose()
            return a, trace

        async_out = _guard(check, "areset/astep", lambda: asyncio.run(twins()))
        if async_out is not None and trace1 is not None:
            check(_same(async_out[0][0], first[0]), "areset and reset gave different observations")
            check(_same(async_out[1], [r[:4] for r in trace1]),
                  "astep and step gave different results for the same seed and actions")

    if not skip_gymnasium and first is not None and _resets_without_a_row(env):
        # What the process left for the garbage collector before (an event loop someone did not close
        # warns "unclosed socket" when collected) is collected now, so it is not blamed on this env.
        gc.collect()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                gymnasium_check_env(env, skip_render_check=True, skip_close_check=True)
            except Exception as exc:
                problems.append(f"gymnasium's check_env failed: {type(exc).__name__}: {exc}")
            finally:
                _guard(check, "close after gymnasium check", env.close)
        for w in caught:
            problems.append(f"gymnasium's check_env warned: {w.message}")

    if problems:
        lines = "\n".join(f"  - {p}" for p in problems)
        raise EnvContractError(
            f"{type(env).__name__} breaks the Env contract in {len(problems)} place(s):\n{lines}"
        )


def _check_ground_truth(check: _Recorder, env: Env, options: dict[str, Any] | None, seed: int) -> None:
    """`requires_ground_truth` is a bool, and the rows this env is checked on agree with it."""
    flag = getattr(type(env), "requires_ground_truth", True)
    if not check(isinstance(flag, bool), f"requires_ground_truth must be a bool class attribute, got {flag!r}"):
        return
    if not flag:
        return
    rows: list[tuple[str, Any]] = []
    if options and isinstance(options.get("row"), dict):
        rows.append(("options['row']", options["row"]))
    elif callable(getattr(env, "generate_row", None)):
        try:
            rows.append((f"generate_row({seed})", env.generate_row(seed)))  # type: ignore[attr-defined]  # an optional hook, checked just above
        except Exception:  # an env that needs a dataset row; reset reports any other failure
            pass
    for label, row in rows:
        problem = ground_truth_problem(row) if isinstance(row, dict) else f"is a {type(row).__name__}"
        check(problem is None,
              f"{type(env).__name__} declares requires_ground_truth = True but the row of {label} has "
              f"none: {problem}; give rows a ground truth, or set requires_ground_truth = False if the env "
              "scores otherwise")


def _resets_without_a_row(env: Env) -> bool:
    """gymnasium's checker calls reset() with no options; it applies only to envs that allow it."""
    try:
        env.reset(seed=0)
    except EnvError:
        return False
    finally:
        env.close()
    return True


class _Recorder:
    def __init__(self, problems: list[str]) -> None:
        self.problems = problems

    def __call__(self, ok: bool, message: str) -> bool:
        if not ok:
            self.problems.append(message)
        return ok


def _guard(check: _Recorder, what: str, fn: Callable[[], Any]) -> Any:
    try:
        out = fn()
    except Exception as exc:
        check.problems.append(f"{what} raised {type(exc).__name__}: {exc}")
        return None
    return out if out is not None else True


def _copy(options: dict[str, Any] | None) -> dict[str, Any] | None:
    return copy.deepcopy(options)


def _rollout(env: Env, actions: Sequence[Action]) -> list[tuple[Any, ...]]:
    trace = []
    for action in actions:
        out = env.step(action)
        trace.append(out)
        if not isinstance(out, tuple) or len(out) != 5 or out[2] or out[3]:
            break
    return trace


def _check_reset(check: _Recorder, env: Env, result: Any) -> None:
    if not check(isinstance(result, tuple) and len(result) == 2,
                 f"reset must return (observation, info), got {type(result).__name__}"):
        return
    obs, info = result
    check(isinstance(obs, list) and len(obs) > 0, "reset must return a non-empty list of chat messages")
    check(env.observation_space.contains(obs),
          "reset's observation is not in observation_space (each message needs a role and str content)")
    if check(isinstance(info, dict), f"reset's info must be a dict, got {type(info).__name__}"):
        tools = info.get("tools")
        if check(isinstance(tools, list), "reset's info must hold 'tools', a list of tool schemas"):
            for i, schema in enumerate(tools):
                fn = schema.get("function") if isinstance(schema, dict) else None
                check(isinstance(schema, dict) and schema.get("type") == "function" and isinstance(fn, dict)
                      and isinstance(fn.get("name"), str)
                      and isinstance(fn.get("parameters"), dict),
                      f"info['tools'][{i}] is not an OpenAI function schema "
                      "({'type': 'function', 'function': {'name', 'description', 'parameters'}})")


def _check_step(check: _Recorder, env: Env, result: Any, index: int) -> None:
    where = f"step #{index + 1}"
    if not check(isinstance(result, tuple) and len(result) == 5,
                 f"{where} must return (observation, reward, terminated, truncated, info), "
                 f"got {type(result).__name__} of length {len(result) if isinstance(result, tuple) else '-'}"):
        return
    obs, reward, terminated, truncated, info = result
    check(env.observation_space.contains(obs),
          f"{where}'s observation must be a list of chat messages (role + str content), got {obs!r:.80}")
    check(isinstance(reward, (int, float)) and not isinstance(reward, bool) and math.isfinite(reward),
          f"{where}'s reward must be a finite float, got {reward!r}")
    check(isinstance(terminated, bool), f"{where}'s terminated must be a bool, got {type(terminated).__name__}")
    check(isinstance(truncated, bool), f"{where}'s truncated must be a bool, got {type(truncated).__name__}")
    check(isinstance(info, dict), f"{where}'s info must be a dict, got {type(info).__name__}")


def _same(a: Any, b: Any) -> bool:
    return gymnasium.utils.env_checker.data_equivalence(_strip_volatile(a), _strip_volatile(b))


def _strip_volatile(x: Any) -> Any:
    """Drop per-call values that legitimately differ between runs (episode ids, timings)."""
    if isinstance(x, dict):
        return {k: _strip_volatile(v) for k, v in x.items()
                if k not in ("episode_id", "duration_s", "elapsed_s")}
    if isinstance(x, (list, tuple)):
        return type(x)(_strip_volatile(v) for v in x)
    return x
