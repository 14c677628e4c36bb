"""`RolloutWorker`: many AgentLoop episodes at once on one asyncio event loop, grouped for GRPO.

A batch is a list of dataset rows (or `None` for environments that generate their own task from
the seed); each row is rolled out `samples_per_prompt` times as one group that shares a
`group_id` and an env seed (so every sample of a group sees the same task; diversity comes from
sampling). Concurrency is capped by a semaphore: callers may ask for any number of episodes and
wait, rather than fail, when the cap is reached. Every episode returns a trajectory, failed ones
included (marked with their fault), so nothing is silently dropped.

Each episode gets a fresh environment from `env_factory`, closed by the AgentLoop at its end.
An environment whose episodes are driven by an external agent rather than by the AgentLoop has
the Env contract's `arun_episode` hook (`agentrl.envs.ExternalAgentEnv`; `agentrl.gateway.AgentEnv`
runs a user's OpenAI-API agent through the gateway): the worker calls it in place of
`loop.run_episode`, and the env plays its episode itself with the worker's AgentLoop as its
inference backend. It may return several trajectories for one episode (segments, when the agent
rewrote its history; they share the episode's reward and `episode_id`, and `Trajectory.segment`
numbers them); so may an episode the AgentLoop compacted (`rollout.compaction`: one trajectory per
context). A group's list then holds every segment of its episodes, in sample order.
Placement on Ray, weight pushes and staleness belong to the orchestration layer, not here.

Garbage collection. A rollout process holds a large, long-lived heap (transformers, the tokenizer,
torch when present: millions of objects), and a thousand episodes allocate fast enough to trigger
a full collection every second or so; each one walks that whole heap and stops the event loop for
50-500 ms. Before its first batch the worker therefore calls `gc.freeze()` once per process
(`freeze_gc=True`), which moves everything alive at that point out of the collector's sight, and
makes full collections rarer (the oldest generation is considered after `_GC_GEN2_THRESHOLD`
young collections instead of 10): with a thousand episodes alive, their objects reach the oldest
generation in waves that would each trigger a full scan of all of them (tens of milliseconds).
The young generations keep their small, frequent, millisecond collections; episode data is
acyclic and freed by reference counting anyway, the collector only finds cycles. Pass
`freeze_gc=False` to leave the collector alone.

Young collections need pacing too. CPython triggers one after 700 net allocations of container
objects, and every deallocation counts against that, including the deaths of old objects: while
one wave of episodes ends and the next starts, the young generation can collect the token lists of
a thousand episodes (1.4 million list items) before a collection runs, which then stops the loop
for 15-35 ms. So while episodes are in flight the worker collects the youngest generation itself
every `GC_PACE_S` (10 ms) and the middle one every fifth time: each pass finds little new
(a few ms at most with 1,000 episodes in flight, `bench/agent_loop.py --sustain-s 120`).

A full collection walks every live object that is not frozen, the token lists of all episodes in
flight included: about 55 ms with 1,000 of them. While episodes are in flight CPython therefore
runs none on its own (the oldest threshold is raised out of reach); the worker runs one when its
last episode ends, if at least `_FULL_AT_IDLE` middle collections happened since the last one
(between batches of a synchronous run, when nobody waits on the loop), and, as a safety net for
runs that never go idle, after `_FULL_AT_LEAST_EVERY` of them (at most about 8 minutes).
When no worker of the process has episodes in flight, the oldest threshold goes back to what it
was (several workers in one process, say training and evaluation, share one pacer).
"""

from __future__ import annotations

import asyncio
import gc
import hashlib
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from agentrl.envs import Env, ExternalAgentEnv
from agentrl.rollout.agent_loop import AgentLoop
from agentrl.types import Trajectory

__all__ = ["RolloutWorker", "group_seed"]

_gc_frozen = False
_GC_GEN2_THRESHOLD = 1_000
GC_PACE_S = 0.01
"""Seconds between the worker's own young-generation collections while episodes are in flight."""
_MIDDLE_EVERY = 5
_FULL_AT_IDLE = 100
_FULL_AT_LEAST_EVERY = 10_000
_NO_AUTOMATIC_FULL = 1 << 30


def _freeze_gc_once() -> None:
    global _gc_frozen
    if not _gc_frozen:
        _gc_frozen = True
        gc.collect()
        gc.freeze()
        gen0, gen1, gen2 = gc.get_threshold()
        gc.set_threshold(gen0, gen1, max(gen2, _GC_GEN2_THRESHOLD))


_pacing_workers = 0  # workers of this process with episodes in flight
_gc_pacer: asyncio.Task[None] | None = None
_saved_gen2_threshold = _GC_GEN2_THRESHOLD


def _start_gc_pacing() -> None:
    """A worker's first episode started: the first such worker takes over the collector."""
    global _pacing_workers, _gc_pacer, _saved_gen2_threshold
    _pacing_workers += 1
    if _pacing_workers == 1:
        gen0, gen1, _saved_gen2_threshold = gc.get_threshold()
        gc.set_threshold(gen0, gen1, _NO_AUTOMATIC_FULL)
        _gc_pacer = asyncio.create_task(_pace_gc(), name="agentrl-gc-pacer")


def _stop_gc_pacing() -> None:
    """A worker's last episode ended: the last such worker hands the collector back."""
    global _pacing_workers, _gc_pacer
    _pacing_workers -= 1
    if _pacing_workers == 0:
        if _gc_pacer is not None:
            _gc_pacer.cancel()
            _gc_pacer = None
        if gc.get_count()[2] >= _FULL_AT_IDLE:
            gc.collect()
        gen0, gen1, _ = gc.get_threshold()
        gc.set_threshold(gen0, gen1, _saved_gen2_threshold)


async def _pace_gc() -> None:
    """Collect the young generations every GC_PACE_S, before they grow large (module docstring)."""
    passes = 0
    while True:
        await asyncio.sleep(GC_PACE_S)
        passes += 1
        if gc.get_count()[2] >= _FULL_AT_LEAST_EVERY:
            gc.collect()
        else:
            gc.collect(1 if passes % _MIDDLE_EVERY == 0 else 0)


def group_seed(base_seed: int, index: int) -> int:
    """A stable 31-bit seed for the `index`-th group of a run seeded with `base_seed`."""
    digest = hashlib.blake2b(f"{base_seed}:{index}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little") & 0x7FFFFFFF


class RolloutWorker:
    """Runs groups of episodes concurrently (see the module docstring)."""

    def __init__(self, loop: AgentLoop, env_factory: Callable[[], Env], *, max_concurrent: int = 256,
                 freeze_gc: bool = True) -> None:
        if max_concurrent < 1:
            raise ValueError(f"max_concurrent must be >= 1, got {max_concurrent}")
        self.loop = loop
        self.env_factory = env_factory
        self.max_concurrent = max_concurrent
        self.freeze_gc = freeze_gc
        self._slots = asyncio.Semaphore(max_concurrent)
        self.in_flight = 0
        self._pacing = False

    async def run_episode(self, row: dict[str, Any] | None, *, seed: int, group_id: str, episode_id: str) -> Trajectory:
        """One episode's trajectory; for an episode that may come in segments use `run_episode_segments`."""
        segments = await self.run_episode_segments(row, seed=seed, group_id=group_id, episode_id=episode_id)
        if len(segments) != 1:
            raise ValueError(f"episode {episode_id} produced {len(segments)} trajectory segments; "
                             "call run_episode_segments to get all of them")
        return segments[0]

    async def run_episode_segments(
        self, row: dict[str, Any] | None, *, seed: int, group_id: str, episode_id: str
    ) -> list[Trajectory]:
        """Every trajectory of one episode: one per context (one, unless `rollout.compaction` closed some) from
        the AgentLoop, one per segment from an external agent."""
        async with self._slots:
            self.in_flight += 1
            if self.freeze_gc and not self._pacing:
                self._pacing = True
                _start_gc_pacing()
            try:
                async with self.loop.gate:  # a thousand episodes admitted at once start in slices
                    env = self.env_factory()
                if isinstance(env, ExternalAgentEnv):
                    return await env.arun_episode(self.loop, row=row, seed=seed, episode_id=episode_id,
                                                  group_id=group_id)
                return await self.loop.run_episode_segments(env, row=row, seed=seed, group_id=group_id,
                                                            episode_id=episode_id)
            finally:
                self.in_flight -= 1
                if self.in_flight == 0 and self._pacing:
                    self._pacing = False
                    _stop_gc_pacing()

    async def run_group(
        self, row: dict[str, Any] | None, samples: int, *, seed: int, group_id: str
    ) -> list[Trajectory]:
        """`samples` episodes of one prompt, in sample order (every segment of each, in order)."""
        # Creating the tasks is paced like any other CPU section: a caller that starts hundreds
        # of groups at once would otherwise spend one long loop iteration creating all of them.
        async with self.loop.gate:
            episodes = asyncio.gather(
                *(
                    self.run_episode_segments(row, seed=seed, group_id=group_id, episode_id=f"{group_id}-{i}")
                    for i in range(samples)
                )
            )
        return [t for segments in await episodes for t in segments]

    async def run_batch(
        self, rows: Sequence[dict[str, Any] | None], samples_per_prompt: int, *, seed: int = 0, first_index: int = 0
    ) -> list[list[Trajectory]]:
        """Every group of the batch, in row order (waits for the slowest)."""
        if self.freeze_gc:
            _freeze_gc_once()
        return list(
            await asyncio.gather(
                *(
                    self.run_group(row, samples_per_prompt, seed=group_seed(seed, first_index + i),
                                   group_id=f"g{first_index + i}")
                    for i, row in enumerate(rows)
                )
            )
        )

    async def stream_groups(
        self, rows: Sequence[dict[str, Any] | None], samples_per_prompt: int, *, seed: int = 0, first_index: int = 0
    ) -> AsyncIterator[list[Trajectory]]:
        """Yield each group as soon as all its samples are done (for asynchronous training)."""
        if self.freeze_gc:
            _freeze_gc_once()
        tasks = [
            asyncio.create_task(
                self.run_group(row, samples_per_prompt, seed=group_seed(seed, first_index + i),
                               group_id=f"g{first_index + i}")
            )
            for i, row in enumerate(rows)
        ]
        try:
            for next_done in asyncio.as_completed(tasks):
                yield await next_done
        finally:
            for t in tasks:
                t.cancel()
