"""SWE instances in images whose toolchain is not the host's: solved by the reference fix only.

The images (tests/swe_images.py) are built here from Debian suites (nothing is pulled): Python 3.13
(SWE-bench format), Python 3.9 (SWE-smith format) and no Python at all (agentrl format). Each is
played through the real env on the real Docker backend by scripted agents (the reference fix,
a plausible wrong fix, no change), through `agentrl eval env=swe sandbox=docker` against a real
HTTP policy server that plays scripted turns, and through `--check`. The reference fixes are shown to fail on the
host's own Python, so only the image's toolchain makes them pass.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from docker_images import docker_sdk
from swe_images import ARGSDOC, BATCHKIT, NAMESPACE, SLUG, SPECS, InstanceSpec, published_row, tag_for_format

from agentrl.envs.swe import SweEnv, reference_fix_actions
from agentrl.envs.swe_tasks import SweTask, task_row
from agentrl.errors import SandboxUnavailableError
from agentrl.types import Action, ToolCall

REPO = Path(__file__).resolve().parents[2]
SUBMIT = [Action("Nothing to change.", (ToolCall("submit", {"summary": "none"}, id="s"),))]
docker_only = pytest.mark.docker


def leftovers() -> list:
    """Containers still there from the test images (of this process or of a CLI it ran)."""
    client = docker_sdk().from_env()
    return [c for tag in {*(s.tag for s in SPECS)} for c in
            client.containers.list(all=True, filters={"ancestor": tag, "label": "agentrl.sandbox=1"})]


@pytest.fixture(scope="module")
def images() -> dict[str, str]:
    if shutil.which("debootstrap") is None and not all(
            subprocess.run(["docker", "image", "inspect", s.base[0]], capture_output=True).returncode == 0 for s in SPECS):
        pytest.skip("building the test images needs debootstrap (apt-get install debootstrap)")
    return {spec.name: tag_for_format(spec) for spec in SPECS}


def task_of(spec: InstanceSpec, patch: str | None = None) -> SweTask:
    task = SweTask.from_dict(published_row(spec), image_namespace=NAMESPACE)
    return dataclasses.replace(task, patch=patch) if patch is not None else task


async def play(env: SweEnv, task: SweTask, actions: list[Action]) -> tuple[float, dict]:
    await env.areset(options={"row": task_row(task)})
    for action in actions:
        _, reward, terminated, truncated, info = await env.astep(action)
        if terminated or truncated:
            return float(reward), info
    raise AssertionError("the episode did not end")


def with_docker(body):  # type: ignore[no-untyped-def]
    from agentrl.sandboxes.docker import DockerSandbox

    async def go():  # type: ignore[no-untyped-def]
        sandbox = DockerSandbox(pool_size=0)
        try:
            return await body(sandbox)
        finally:
            await sandbox.close()

    return asyncio.run(go())


@docker_only
@pytest.mark.parametrize("spec", SPECS, ids=[s.name for s in SPECS])
@pytest.mark.slow  # builds its images with debootstrap where none exist: minutes on a fresh machine
def test_an_image_keeps_its_own_toolchain_and_files(images: dict[str, str], spec: InstanceSpec) -> None:
    async def body(sandbox):  # type: ignore[no-untyped-def]
        session = await sandbox.session(image=images[spec.name], workdir="/testbed")
        try:
            probe = await session.exec(
                "python3 -c 'import sys; print(sys.version_info[:2])' 2>/dev/null || echo no-python; "
                f"test -e {sys.base_prefix} && echo host-python-visible; id -u; pwd; git log --oneline | wc -l; "
                "ln -s /etc link", timeout_s=30)
            await session.write_file("notes/new.txt", "written from the host side\n")
            back = await session.read_file("notes/new.txt")
            outcomes = []
            for path in ("link/passwd", "../etc/passwd", "/etc/passwd"):
                try:
                    await session.read_file(path)
                    outcomes.append("read")
                except (PermissionError, ValueError) as exc:
                    outcomes.append(type(exc).__name__)
            return probe, back, outcomes
        finally:
            await session.close()

    probe, back, outcomes = with_docker(body)
    version = {"batchkit": "(3, 13)", "argsdoc": "(3, 9)", "slug": "no-python"}[spec.name]
    assert probe.stdout.split() == [*version.split(), "0", "/testbed", "1"], probe
    assert back == b"written from the host side\n"
    assert outcomes == ["PermissionError", "ValueError", "ValueError"]
    assert leftovers() == []


@docker_only
@pytest.mark.parametrize("spec", SPECS, ids=[s.name for s in SPECS])
@pytest.mark.slow  # builds its images with debootstrap where none exist: minutes on a fresh machine
def test_the_reference_fix_resolves_and_a_wrong_fix_does_not(images: dict[str, str], spec: InstanceSpec) -> None:
    task = task_of(spec)
    assert task.image == images[spec.name] and task.format == {"batchkit": "swe-bench", "argsdoc": "swe-smith",
                                                                "slug": "agentrl"}[spec.name]

    async def body(sandbox):  # type: ignore[no-untyped-def]
        env = SweEnv(sandbox=sandbox)
        try:
            return [await play(env, task, reference_fix_actions(task)),
                    await play(env, task, reference_fix_actions(task_of(spec, spec.wrong_patch()))),
                    await play(env, task, SUBMIT)]
        finally:
            await env.aclose()

    (fixed, info), (wrong, wrong_info), (idle, idle_info) = with_docker(body)
    assert (fixed, wrong, idle) == (1.0, 0.0, 0.0), (info["swe"], wrong_info["swe"], idle_info["swe"])
    assert set(info["swe"]["statuses"].values()) == {"PASSED"}
    assert info["swe"]["model_patch"].startswith("diff --git") and "test" not in info["swe"]["model_patch"].split("\n")[0]
    for verdict in (wrong_info["swe"], idle_info["swe"]):
        assert verdict["fail_to_pass_passed"] < verdict["fail_to_pass_total"]
    assert leftovers() == []


@pytest.mark.parametrize(("spec", "error"), [(BATCHKIT, "cannot import name 'batched'"),
                                             (ARGSDOC, "has no attribute 'getargspec'")], ids=["py3.13", "py3.9"])
def test_the_reference_fix_fails_on_the_hosts_python(tmp_path: Path, spec: InstanceSpec, error: str) -> None:
    files = {**spec.repo, **spec.hidden_tests, **spec.fix}
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and error in out.stdout + out.stderr, out.stdout[-2000:]


@docker_only
@pytest.mark.slow  # builds its images with debootstrap where none exist: minutes on a fresh machine
def test_a_budget_that_ends_the_episode_grades_the_current_diff(images: dict[str, str]) -> None:
    task = task_of(BATCHKIT)
    edits = reference_fix_actions(task)[:-1]  # the fix's edits, no submit: the loop's budget runs out first

    async def body(sandbox):  # type: ignore[no-untyped-def]
        env = SweEnv(sandbox=sandbox)
        try:
            await env.areset(options={"row": task_row(task)})
            steps = [await env.astep(edit) for edit in edits]
            assert not any(terminated or truncated for _, _, terminated, truncated, _ in steps)
            return steps[-1][0], await env.atruncate("rollout.max_turns")
        finally:
            await env.aclose()

    obs, (reward, info) = with_docker(body)
    assert "has been edited" in obs[0]["content"]
    assert (reward, info["truncated_by"], info["metrics"]["resolved"]) == (1.0, "rollout.max_turns", 1.0)


@docker_only
def test_an_instance_whose_image_is_missing_says_how_to_get_it() -> None:
    row = {**published_row(BATCHKIT), "instance_id": "batchkit__batchkit-404"}
    task = SweTask.from_dict(row, image_namespace=NAMESPACE)

    async def body(sandbox):  # type: ignore[no-untyped-def]
        env = SweEnv(sandbox=sandbox)
        try:
            with pytest.raises(SandboxUnavailableError, match=r"docker pull agentrl-swe-test/sweb\.eval\.x86_64\."
                                                              r"batchkit_1776_batchkit-404:latest"):
                await env.areset(options={"row": task_row(task)})
        finally:
            await env.aclose()

    with_docker(body)


@docker_only
@pytest.mark.slow
def test_agentrl_eval_with_the_docker_sandbox(images: dict[str, str], assets: Path, tmp_path: Path) -> None:
    from swe_scripted_server import ScriptedPolicyServer
    from transformers import AutoTokenizer

    published = tmp_path / "published.jsonl"
    published.write_text("".join(json.dumps(published_row(s)) + "\n" for s in (BATCHKIT, ARGSDOC)))
    rows = tmp_path / "rows.jsonl"
    convert = subprocess.run([str(Path(sys.executable).parent / "agentrl"), "swe", "convert", str(published), str(rows),
                              "--image-namespace", NAMESPACE], capture_output=True, text=True, timeout=120)
    assert convert.returncode == 0, convert.stderr
    model = assets / "qwen2.5-0.5b-instruct"
    plays = {BATCHKIT.name: reference_fix_actions(task_of(BATCHKIT)),  # the fix: resolved
             ARGSDOC.name: reference_fix_actions(task_of(ARGSDOC, ARGSDOC.wrong_patch()))}  # a wrong fix: not
    keys = {task_of(s).problem_statement.split(":")[0]: plays[s.name] for s in (BATCHKIT, ARGSDOC)}
    with ScriptedPolicyServer(AutoTokenizer.from_pretrained(model), keys) as server:
        out = subprocess.run(
            [str(Path(sys.executable).parent / "agentrl"), "eval", "env=swe", "sandbox=docker", "sandbox.kwargs.pool_size=0",
             f"model.path={model}", f"inference.urls=[{server.url}]",
             f"data.val_files=[{rows}]", f"eval.output_dir={tmp_path / 'eval'}", "rollout.max_tokens_per_turn=1024",
             "rollout.max_concurrent_episodes=2"],
            capture_output=True, text=True, timeout=900, cwd=REPO)
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        assert server.requests >= 3
    report = json.loads((tmp_path / "eval" / "report.json").read_text())
    assert (report["problems"], report["infra_failed_episodes"], report["resolved_rate"]) == (2, 0, 0.5)
    trajs = {t["ground_truth"]: t for t in map(json.loads, (tmp_path / "eval" / "trajectories.jsonl").open())}
    assert trajs["batchkit__batchkit-1"]["reward"] == 1.0
    assert trajs["argsdoc__argsdoc.0001.describe_defaults"]["reward"] == 0.0
    assert leftovers() == []


@docker_only
@pytest.mark.slow
def test_check_lists_the_broken_instances(images: dict[str, str], tmp_path: Path) -> None:
    broken_fix = {**published_row(BATCHKIT), "instance_id": "batchkit__batchkit-2",
                  "patch": BATCHKIT.wrong_patch()}
    no_image = {**published_row(SLUG), "instance_id": "slug__gone", "image": "agentrl-swe-test/slug:absent"}
    no_bug = {**published_row(SLUG), "instance_id": "slug__already", "FAIL_TO_PASS": ["test_words (slug.tests)"],
              "PASS_TO_PASS": []}
    rows = [published_row(s) for s in SPECS] + [broken_fix, no_image, no_bug]
    docker_sdk().from_env().images.get(images["batchkit"]).tag(f"{NAMESPACE}/sweb.eval.x86_64.batchkit_1776_batchkit-2",
                                                         "latest")
    path = tmp_path / "instances.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = subprocess.run([str(Path(sys.executable).parent / "agentrl"), "swe", "check", str(path), "--image-namespace",
                          NAMESPACE, "--report", str(tmp_path / "check.json"), "--concurrency", "2"],
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 1, out.stdout + out.stderr
    results = {r["instance_id"]: r for r in json.loads((tmp_path / "check.json").read_text())}
    assert {i for i, r in results.items() if r["ok"]} == {"batchkit__batchkit-1", "argsdoc__argsdoc.0001.describe_defaults",
                                                          "slug__collapse-separators"}
    assert results["batchkit__batchkit-2"]["problem"] == "fix does not resolve"
    assert "test_strict_rejects_a_short_last_batch" in results["batchkit__batchkit-2"]["detail"]
    assert results["slug__gone"]["problem"] == "image missing"
    assert results["slug__already"]["problem"] == "resolved without a fix"
    assert "6 instances: 3 ok, 3 broken" in out.stdout
    assert leftovers() == []
