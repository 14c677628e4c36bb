"""What a run is, recorded when it starts and compared at every resume: `run_identity`, `check_resume`.

A checkpoint continues the run that wrote it only with the config that shaped that run's data and
model. `run_identity(config)` is that config as flat dotted keys: the env (`env.name`,
`env.kwargs`), every `data.*` key (the train and val files as given, and
`data.train_files.sha256` / `data.val_files.sha256`, the SHA-256 of each file's content, so a
different file under the same name or size is seen), `run.seed`, the model (`model.path`,
`model.tokenizer`, `model.chat_template`, `model.tool_parser`, `model.dtype`), every
`algorithm.*` key and the distillation objective (`distill.teacher`: the teacher's model_path or url,
`distill.mode`, `distill.coef`; None each without `distill`, as in identities recorded before them). Budgets, logging and step counts are not in it: a resume may change those.

A run's first start writes it into `run_identity.json` in the run directory. `check_resume(config,
run_dir)` compares a resume's identity with it before anything starts (the `Run` calls it before
pre-flight, `agentrl validate` when it sees `resume=true`) and raises ConfigError naming every
differing key with its recorded and its new value, unless `run.resume_allow` lists the key (or a
section above it, `data` for every data key), in which case the difference is allowed: the
`Run` then records it (`record_resume`: a line in `resume_history.jsonl`, the new identity in
`run_identity.json`, and its log). A run directory written before identities existed has none: the
resume is let through with one warning, and its identity is recorded from then on. This module
reads and writes only those two files.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agentrl.config import AgentRLConfig
from agentrl.errors import ConfigError
from agentrl.records.run_files import append_text, replace_text
from agentrl.registry import closest_names

__all__ = ["IDENTITY_FILE", "RESUME_HISTORY", "ResumeCheck", "check_resume", "record_resume", "run_identity",
           "write_identity"]

IDENTITY_FILE = "run_identity.json"
RESUME_HISTORY = "resume_history.jsonl"
_MODEL_KEYS = ("path", "tokenizer", "chat_template", "tool_parser", "dtype")
_CHUNK = 8 << 20


def _sha256(path: str) -> str | None:
    digest = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            while chunk := f.read(_CHUNK):
                digest.update(chunk)
    except OSError:
        return None  # the build names a missing file; here it simply differs from a recorded digest
    return digest.hexdigest()


def run_identity(config: AgentRLConfig) -> dict[str, Any]:
    """The config that shapes a run's data and model, as dotted keys (see the module docstring)."""
    dumped = config.model_dump(mode="json")
    identity: dict[str, Any] = {"env.name": dumped["env"]["name"], "env.kwargs": dumped["env"]["kwargs"]}
    for key, value in dumped["data"].items():
        identity[f"data.{key}"] = value
    for key in ("train_files", "val_files"):
        identity[f"data.{key}.sha256"] = [_sha256(p) for p in dumped["data"][key]]
    identity["run.seed"] = dumped["run"]["seed"]
    for key in _MODEL_KEYS:
        identity[f"model.{key}"] = dumped["model"][key]
    for key, value in dumped["algorithm"].items():
        identity[f"algorithm.{key}"] = value
    # from the dump, as every key above: the identity is not one of a field's readers
    distill = dumped["distill"] or {}
    teacher = distill.get("teacher") or {}
    identity["distill.teacher"] = teacher.get("model_path") or teacher.get("url")
    identity["distill.mode"] = distill.get("mode")
    identity["distill.coef"] = distill.get("coef")
    return identity


@dataclass
class ResumeCheck:
    """What `check_resume` found: the identity of this attempt and what differs but is allowed."""

    identity: dict[str, Any]
    """This config's identity (a resume's; empty for a fresh start, which has nothing to compare)."""
    allowed: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Each differing key `run.resume_allow` lets through: {"old": recorded, "new": this config's}."""
    recorded: bool = True
    """False when the run directory holds no identity (written by an older agentrl)."""

    def notes(self) -> list[str]:
        """Lines for the run's log."""
        if not self.recorded:
            return [f"this run directory has no {IDENTITY_FILE} (it was started by an older agentrl), so this "
                    "resume cannot be checked against the config the run started with; it is recorded now, and "
                    "later resumes are checked against it"]
        return [f"resume with a changed {key} (allowed by run.resume_allow): {_shown(d['old'])} -> {_shown(d['new'])}"
                for key, d in self.allowed.items()]


def _shown(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 160 else text[:157] + "..."


def _covers(entry: str, key: str) -> bool:
    return key == entry or key.startswith(entry + ".")


def check_resume(config: AgentRLConfig, run_dir: Path) -> ResumeCheck:
    """Compare `config` with the identity recorded in `run_dir` (see the module docstring); raise
    ConfigError naming each difference that `run.resume_allow` does not list. Writes nothing.

    Without `run.resume` it only checks that `run.resume_allow` is empty (it does nothing then)."""
    allow = list(config.run.resume_allow)
    if not config.run.resume:
        if allow:
            raise ConfigError(f"run.resume_allow={allow} is given but run.resume is false: it only applies to a "
                              "resume. Add resume=true to continue the run, or remove run.resume_allow.")
        return ResumeCheck(identity={})  # a fresh start records `run_identity(config)` itself
    identity = run_identity(config)
    keys = list(identity)
    unknown = [e for e in allow if not any(_covers(e, k) for k in keys)]
    if unknown:
        named = []
        for entry in unknown:
            close = closest_names(entry, keys)
            named.append(f"'{entry}'" + (f" (did you mean '{close[0]}'?)" if close else ""))
        raise ConfigError(
            f"run.resume_allow names keys a resume does not compare: {', '.join(named)}. It takes the keys "
            f"a refused resume names, or the sections above them ({', '.join(sorted({k.split('.')[0] for k in keys}))})."
        )
    path = run_dir / IDENTITY_FILE
    if not path.is_file():
        return ResumeCheck(identity=identity, recorded=False)
    try:
        recorded = json.loads(path.read_text())["identity"]
        if not isinstance(recorded, dict):
            raise TypeError(f"'identity' is a {type(recorded).__name__}")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(
            f"{path} cannot be read ({type(exc).__name__}: {exc}), so this resume cannot be checked against "
            f"the run. Restore the file from a copy, or, to resume anyway, move it away (the resume then "
            "records this config's identity)."
        ) from exc
    differing = {k: {"old": recorded.get(k), "new": identity.get(k)}
                 for k in sorted(set(recorded) | set(identity)) if recorded.get(k) != identity.get(k)}
    refused = {k: d for k, d in differing.items() if not any(_covers(e, k) for e in allow)}
    if refused:
        listed = "\n".join(f"  {k}: {_shown(d['old'])} -> {_shown(d['new'])}" for k, d in refused.items())
        raise ConfigError(
            f"resume=true: this config differs from the run in '{run_dir}' (recorded in {IDENTITY_FILE}) in what "
            f"shapes its data and model, {len(refused)} key(s), recorded -> given:\n{listed}\n"
            f"Nothing was started and nothing in the run directory was changed. Resume with the run's own config "
            f"(agentrl run {run_dir / 'config.yaml'} resume=true), start a new run under another run.name, or, "
            f"to continue with the change on purpose, list the keys: run.resume_allow=[{','.join(refused)}]."
        )
    return ResumeCheck(identity=identity, allowed=differing)


def write_identity(run_dir: Path, identity: dict[str, Any]) -> Path:
    """Write `identity` into `run_dir/run_identity.json` (replacing it atomically); return the file."""
    path = run_dir / IDENTITY_FILE
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    replace_text(path, json.dumps({"format": 1, "written_at": stamp, "identity": identity}, indent=1), run_dir)
    return path


def record_resume(run_dir: Path, check: ResumeCheck, checkpoint: str) -> None:
    """Record an accepted resume: a line in `resume_history.jsonl` (what was allowed to change), and
    this config's identity in `run_identity.json` when it changed or was missing."""
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    entry = {"at": stamp, "checkpoint": checkpoint, "allowed": check.allowed, "identity_recorded": check.recorded}
    append_text(run_dir / RESUME_HISTORY, json.dumps(entry) + "\n", run_dir)
    if check.allowed or not check.recorded:
        write_identity(run_dir, check.identity)
