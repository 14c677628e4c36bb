"""Fixtures of the fault-injection suite: the run environment and the session's vLLM server (the
cheap run config and the checks every fault test makes are in `fault_common`).

Runs that only need *a* server share the session's vLLM (`inference.urls`), as the e2e tests do;
runs whose fault is the server itself start their own (`inference.max_model_len=1024` tells them
apart from the shared one, whose context is 2048). At the end the shared server gets its base
weights back and Ray is shut down.
"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fault_common import shutdown_ray  # noqa: F401  (the fault tests' helpers: fault_common)

HERE = Path(__file__).resolve().parent
E2E = HERE.parent / "e2e"
for folder in (HERE, E2E):
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))




@pytest.fixture(scope="session", autouse=True)
def _run_environment() -> None:
    os.environ.setdefault("RAY_TMPDIR", "/tmp/ray-faults")
    # as `agentrl run` does: driver.log gets the run's INFO lines (restarts, re-syncs, resumes)
    import logging

    logging.getLogger("agentrl").setLevel(logging.INFO)


@pytest.fixture(scope="module")
def shared_url(vllm_server, assets: Path):
    """The session's vLLM server; restored to the base weights after the module's runs."""
    from agentrl.inference import HTTPServerClient

    yield vllm_server.url

    async def restore() -> None:
        client = HTTPServerClient(vllm_server.url)
        await client.update_weights(str(assets / "tiny-random-qwen2"), 0)
        await client.aclose()

    asyncio.run(restore())
    import ray

    ray.shutdown()


