"""The `agentrl` command line: run, eval, sft, dpo, plot, view, serve, gateway, sandbox, swe, envs, tools, config, validate,
doctor, check, version.

Each subcommand parses its arguments, builds what it needs from the layers below, and turns any
`AgentRLError` into one readable message and exit status 1 (2 for a command-line usage error). A run
stopped by Ctrl-C, SIGTERM or SIGHUP exits with 128 + the signal's number (130, 143, 129), saying how
to continue it; any other command stopped by Ctrl-C exits 130.
Imports are deferred into the subcommands, so `agentrl --help` and `agentrl envs list` stay fast and
never import torch. Subcommands whose machinery is not built yet say so and exit with status 3.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any, Literal

__all__ = ["build_parser", "main"]

EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_UNAVAILABLE = 3

_CONFIG_HELP = (
    "a YAML file or a preset name (see 'agentrl config --presets'); "
    "then key.sub=value overrides, e.g. env=arithmetic trainer.lr=1e-6 rollout.max_turns=4"
)


def build_parser() -> argparse.ArgumentParser:
    from agentrl import __version__

    parser = argparse.ArgumentParser(
        prog="agentrl",
        description="Train and evaluate LLM agents with RL on multi-turn tool use.",
        epilog="Start with: agentrl run env=retool   (see README.md)",
    )
    parser.add_argument("--version", action="version", version=f"agentrl {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    for name, help_text in (
        ("run", "train a policy with RL (e.g. agentrl run env=retool)"),
        ("eval", "score an agent offline on an environment's dataset"),
        ("serve", "start LLM servers and the router from a config"),
        ("validate", "check a config and build every piece of the job it describes, starting nothing"),
        ("doctor", "check that a job can run here: build it and run the pre-flight checks"),
    ):
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.add_argument("args", nargs="*", metavar="CONFIG_OR_OVERRIDE", help=_CONFIG_HELP)
        if name in ("validate", "doctor"):
            p.add_argument("--eval", action="store_true", dest="for_eval",
                           help="check the config for 'agentrl eval' rather than 'agentrl run'")
        if name == "validate":
            p.add_argument("--show", action="store_true", help="print the resolved config as YAML")
        if name == "serve":
            p.add_argument("--log-dir", default=None, help="write each server's log here")

    for name, help_text in (
        ("sft", "supervised warm-up: train on demonstration rows, loss on the assistant's tokens only"),
        ("dpo", "preference training (dpo, ipo, dpo_norm) on chosen/rejected rows against the initial weights"),
    ):
        p = sub.add_parser(name, help=help_text, description=f"{help_text}. The rows' formats, the math and the "
                           "commands: docs/preferences.md.")
        p.add_argument("args", nargs="*", metavar="CONFIG_OR_OVERRIDE", help=_CONFIG_HELP)

    p = sub.add_parser(
        "gateway", help="serve the policy behind an OpenAI-compatible API and record every agent's tokens",
        description="Start the configured LLM servers and an OpenAI-compatible gateway in front of them, for "
        "offline evaluation of any OpenAI-API agent: point it at http://HOST:PORT/v1 with one API key per "
        "run (or at http://HOST:PORT/s/RUN/v1); each run's token ledger is appended to OUT/trajectories.jsonl "
        "when it ends (POST /agentrl/sessions/KEY/end, optionally with {\"reward\": r}), after --idle-timeout, "
        "or at Ctrl-C.")
    p.add_argument("args", nargs="*", metavar="CONFIG_OR_OVERRIDE", help=_CONFIG_HELP)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8400, help="port to bind (default: 8400; 0 picks a free one)")
    p.add_argument("--out", default=None, help="where trajectories.jsonl goes (default: RUN.OUTPUT_DIR/gateway-<time>)")
    p.add_argument("--idle-timeout", type=float, default=600.0,
                   help="end a session after this many seconds without a call (default: 600)")

    p = sub.add_parser("plot", help="draw a run's metric curves to PNG files")
    p.add_argument("run_dir", help="the run directory (holds metrics.jsonl)")
    p.add_argument("--out", default=None, help="where the PNGs go (default: RUN_DIR/plots)")
    p.add_argument("--keys", nargs="*", help="metrics to draw (default: the dashboard's main curves)")

    p = sub.add_parser("view", help="look at a run's episodes and curves in the browser (a local page)",
                       description="Serve a local page over a run directory, an 'agentrl eval' directory or a "
                                   "trajectories .jsonl file: the dashboard curves, each step's kept rollouts, each "
                                   "evaluation, and every episode turn by turn with its tokens coloured by origin.")
    p.add_argument("run_dir", help="a run directory (runs/NAME), an eval directory or a trajectories .jsonl file")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, this machine only)")
    p.add_argument("--port", type=int, default=0, help="port to bind (default: a free one)")
    p.add_argument("--open", action="store_true", help="open the page in the default browser")

    p = sub.add_parser("config", help="list every config key with its type, default and meaning")
    p.add_argument("section", nargs="?", help="only keys under this section (e.g. trainer)")
    p.add_argument("--presets", action="store_true", help="list the shipped YAML presets instead")

    p = sub.add_parser("sandbox", help="sandbox backends: list them, or serve one over HTTP")
    ssub = p.add_subparsers(dest="sandbox_command", metavar="SUBCOMMAND")
    ssub.add_parser("list", help="list sandbox backends")
    sp = ssub.add_parser("serve", help="expose the local sandbox over HTTP for remote rollout workers")
    sp.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    sp.add_argument("--port", type=int, default=8765, help="port to bind (default: 8765)")
    sp.add_argument("--token", default=None, help="bearer token clients must send (default: $AGENTRL_SANDBOX_TOKEN)")
    sp.add_argument("--max-concurrency", type=int, default=None, help="most executions at once")
    sp.add_argument("--backend", default="local",
                    help="sandbox backend behind the server: local (bubblewrap) or docker (instance images)")

    p = sub.add_parser("swe", help="SWE task instances: convert published rows to verl rows, check them")
    wsub = p.add_subparsers(dest="swe_command", metavar="SUBCOMMAND")
    instances_help = "SWE instances: JSONL, JSON or Parquet, any supported format"
    format_help = "the rows' published format: agentrl, swe-bench, swe-gym, swe-smith, r2e-gym (default: auto, detect)"
    namespace_help = "registry namespace of SWE-bench images ('' for images built by its harness; default: swebench)"
    wp = wsub.add_parser("convert", help="write SWE instances as verl dataset rows (JSONL) for data.*_files",
                         description="Read SWE instances (SWE-bench, SWE-Gym, SWE-smith, R2E-Gym or agentrl rows) "
                                     "and write verl dataset rows that carry them, for data.train_files/val_files.")
    wp.add_argument("instances", help=instances_help)
    wp.add_argument("rows", help="where to write the verl rows (JSONL)")
    wp.add_argument("--format", default="auto", help=format_help)
    wp.add_argument("--image-namespace", default="swebench", help=namespace_help)
    wp = wsub.add_parser("check", help="replay each instance's reference fix and list the broken ones",
                         description="Play every instance twice through the real SWE env: with its reference fix "
                                     "(must resolve) and unchanged (must not). Lists the broken instances (image "
                                     "missing, fix not applying or not resolving, tests already passing, "
                                     "infrastructure errors); exits 1 if any is broken.")
    wp.add_argument("instances", help=instances_help)
    wp.add_argument("--format", default="auto", help=format_help)
    wp.add_argument("--image-namespace", default="swebench", help=namespace_help)
    wp.add_argument("--sandbox", default="docker", help="sandbox backend to play them on (default: docker)")
    wp.add_argument("--limit", type=int, default=None, help="check only the first N instances")
    wp.add_argument("--concurrency", type=int, default=2, help="instances checked at once (default: 2)")
    wp.add_argument("--report", default=None, help="also write the results as JSON here")

    p = sub.add_parser("envs", help="environments")
    esub = p.add_subparsers(dest="envs_command", metavar="SUBCOMMAND")
    esub.add_parser("list", help="list registered environments")

    p = sub.add_parser("tools", help="tools and tool-call parsers")
    tsub = p.add_subparsers(dest="tools_command", metavar="SUBCOMMAND")
    tsub.add_parser("list", help="list registered tools")
    tsub.add_parser("parsers", help="list tool-call parsers")

    p = sub.add_parser("check", help="conformance checks of a config before paying for a run")
    csub = p.add_subparsers(dest="check_command", metavar="SUBCOMMAND")
    cp = csub.add_parser("onpolicy", help="roll out a few rows on the config's engine and check the trainer "
                         "scores them on-policy (template, logprob gap, kept set, cache, dtype)")
    cp.add_argument("args", nargs="*", metavar="CONFIG_OR_OVERRIDE", help=_CONFIG_HELP)
    cp.add_argument("--rows", type=int, default=4, help="dataset rows to roll out, one episode each (default: 4)")
    cp.add_argument("--json", action="store_true", help="print the report as JSON")
    cp.add_argument("--no-dtype", action="store_true", help="skip the bf16 vs fp32 scoring check")
    cp.add_argument("--no-placement", action="store_true",
                    help="skip the colocated vs split check (it builds a second engine in this process)")

    sub.add_parser("version", help="print the agentrl version")
    return parser


# ── subcommands ─────────────────────────────────────────────────────────────────────────────


def _split_config_args(args: Sequence[str]) -> tuple[str | None, list[str]]:
    if args and "=" not in args[0]:
        return args[0], list(args[1:])
    return None, list(args)


def _load(args: Sequence[str]) -> Any:
    from agentrl.config import load_config

    config, overrides = _split_config_args(args)
    return load_config(config, overrides)


def _purpose(cfg: Any, for_eval: bool) -> Literal["run", "eval"]:
    return "eval" if for_eval or cfg.inference.engine == "external" else "run"


def cmd_validate(ns: argparse.Namespace) -> int:
    import asyncio

    import yaml

    from agentrl.orchestration.build import build_job
    from agentrl.orchestration.driver import check_run_dir

    cfg = _load(ns.args)
    purpose = _purpose(cfg, ns.for_eval)
    job = build_job(cfg, purpose)
    sandbox = cfg.sandbox.name if job.sandbox is not None else "none"
    asyncio.run(job.aclose())
    # A run's directory: a resume must match the run it continues (checked as `agentrl run` would).
    run_dir_lines = [] if ns.for_eval else check_run_dir(cfg)
    if ns.show:
        sys.stdout.write(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
    else:
        rows = len(job.train_rows) if purpose == "run" else len(job.val_rows)
        print(f"Config OK for 'agentrl {purpose}': env={cfg.env.name} model={cfg.model.path} "
              f"engine={cfg.inference.engine} mode={cfg.run.mode} steps={cfg.run.total_steps} "
              f"sandbox={sandbox} rows={rows}")
        print(f"tool parser: {job.parser_choice}")
        if job.teacher is not None:  # its tokenizer was checked against the policy's by the build
            print(f"teacher: {job.teacher.describe()}, its tokenizer the policy's; started by pre-flight")
        lines = job.plan.describe() if job.plan is not None else []
        if job.plan is not None and job.plan.cluster is not None:
            from agentrl.orchestration.cluster import (
                gpu_sharing_warnings,
                trial_placement,
                unauthenticated_join,
            )

            # Where each process lands, as the cluster grants it now (it must hold the plan), and
            # whether each node can run its part (the model there, CUDA for a cuda trainer).
            lines = lines[: len(lines) - len(job.plan.cluster.describe())] + trial_placement(
                job.plan.cluster, model=cfg.model.path, trainer_cuda=cfg.trainer.device == "cuda")
            lines += [f"warning: {w}" for w in gpu_sharing_warnings(cfg)]
            open_door = unauthenticated_join(job.plan.cluster.address)
            if open_door:
                lines.append(f"warning: {open_door}")
        for line in lines:
            print(line)
        for line in run_dir_lines:
            print(line)
        for note in job.notes:
            print(f"note: {note}")
    return 0


def cmd_doctor(ns: argparse.Namespace) -> int:
    import asyncio

    from agentrl.errors import AgentRLError
    from agentrl.orchestration.build import build_job
    from agentrl.orchestration.preflight import run_checks

    cfg = _load(ns.args)
    purpose = _purpose(cfg, ns.for_eval)
    print(f"Checking 'agentrl {purpose}' with env={cfg.env.name} model={cfg.model.path} ...", flush=True)
    try:
        job = build_job(cfg, purpose)
    except AgentRLError as exc:
        print(f"[FAIL] build: {exc}")
        return EXIT_ERROR
    print("[ok  ] build: the model, tokenizer, chat template, parser, env, sandbox and dataset are built")
    try:
        checks = run_checks(job)
    finally:
        asyncio.run(job.aclose())
    for check in checks:
        print(check.line())
    failed = [c for c in checks if not c.ok]
    print(f"{len(failed)} problem(s) found." if failed else "Everything this job needs is here.")
    return EXIT_ERROR if failed else 0


def cmd_not_built(what: str, issue: str, hint: str = "Your config can already be checked with 'agentrl validate'.") -> int:
    from agentrl.errors import FeatureUnavailableError

    raise FeatureUnavailableError(
        f"'agentrl {what}' is not available yet: {issue} is still being built. {hint}"
    )


def _built(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def _log_to_console() -> None:
    import logging

    from agentrl.records.library_logs import quiet_libraries

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", datefmt="%H:%M:%S"))
    handler._agentrl_console = True  # type: ignore[attr-defined]  # our mark on a stdlib handler
    root = logging.getLogger("agentrl")
    for old in [h for h in root.handlers if getattr(h, "_agentrl_console", False)]:
        root.removeHandler(old)  # one console handler, on the stderr of now (main() may run again in a process)
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    quiet_libraries()  # other libraries' notices go to the run's log file, not the console


def _job_usage(command: str) -> str:
    """What to type for `agentrl run` / `agentrl eval` (printed when they are given nothing)."""
    from agentrl.config import list_presets
    from agentrl.registry import ENVS

    what = "train a policy with RL" if command == "run" else "score an agent offline"
    example, override = (
        ("agentrl run env=retool            # the README's first job", "run.total_steps=10")
        if command == "run"
        else ("agentrl eval env=retool eval.k=4 eval.max_rows=50", "model.path=runs/NAME/weights/version-N")
    )
    return "\n".join([
        f"usage: agentrl {command} [CONFIG] key=value ...   ({what})",
        "",
        "  CONFIG is a preset name or a YAML file; env=NAME alone picks the preset of that name.",
        f"  e.g.  {example}",
        f"        agentrl {command} my.yaml {override}",
        "",
        f"  presets:       {', '.join(list_presets())}",
        f"  environments:  {', '.join(ENVS.names())}",
        "  every key:     agentrl config [SECTION]      check first: agentrl validate env=NAME",
    ])


def cmd_run(ns: argparse.Namespace) -> int:
    from agentrl.orchestration.driver import run_training
    from agentrl.orchestration.interrupts import RunInterrupted

    if not ns.args:  # a bare `agentrl run` shows what to type instead of starting a default job
        print(_job_usage("run"), file=sys.stderr)
        return EXIT_USAGE
    cfg = _load(ns.args)
    _log_to_console()
    try:
        result = run_training(cfg)
    except RunInterrupted as exc:  # Ctrl-C, SIGTERM or SIGHUP: 128 + the signal's number, as a shell reports it
        print(f"agentrl run: {exc}", file=sys.stderr)
        return exc.exit_status
    print(result.summary())
    print(f"metrics: {result.run_dir}/metrics.jsonl   plots: agentrl plot {result.run_dir}   "
          f"episodes: agentrl view {result.run_dir}")
    return 0


def cmd_offline(ns: argparse.Namespace) -> int:
    """`agentrl sft` and `agentrl dpo`: `algorithm.objective` defaults to the command's own."""
    from agentrl.orchestration.offline_training import run_offline

    if not ns.args:
        print(f"usage: agentrl {ns.command} [CONFIG] key=value ...   e.g. agentrl {ns.command} "
              f"data.train_files=[{'demos' if ns.command == 'sft' else 'pairs'}.jsonl] (docs/preferences.md)",
              file=sys.stderr)
        return EXIT_USAGE
    config, overrides = _split_config_args(ns.args)
    if not any(o.startswith("algorithm.objective=") for o in overrides):
        overrides = [f"algorithm.objective={ns.command}", *overrides]
    from agentrl.config import load_config

    cfg = load_config(config, overrides)
    _log_to_console()
    result = run_offline(cfg, ns.command)
    print(result.summary())
    print(f"metrics: {result.run_dir}/metrics.jsonl   plots: agentrl plot {result.run_dir}")
    print(f"policy: {result.weights_dir}   (RL from it: agentrl run env=NAME model.path={result.weights_dir})")
    return 0


def cmd_plot(ns: argparse.Namespace) -> int:
    from agentrl.records.plot import plot_run

    written = plot_run(ns.run_dir, ns.out, keys=ns.keys or None)
    for path in written:
        print(path)
    return 0


def cmd_view(ns: argparse.Namespace) -> int:
    from agentrl.viewer import ViewerServer

    try:
        server = ViewerServer(ns.run_dir, host=ns.host, port=ns.port)
    except OSError as exc:
        from agentrl.errors import ConfigError

        raise ConfigError(f"cannot listen on {ns.host}:{ns.port}: {exc}; pick another --port (0: a free one).") from exc
    print(f"agentrl view: {server.reader.root} at {server.url}  (Ctrl-C stops it)", flush=True)
    if ns.open:
        import webbrowser

        webbrowser.open(server.url)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0


class _EvalProgressLine:
    """Renders `agentrl eval`'s progress on stderr: one line rewritten in place on a terminal, a
    line at most every `every_s` seconds (and the last one) when stderr is a file or a pipe."""

    def __init__(self, every_s: float = 10.0) -> None:
        self.tty = sys.stderr.isatty()
        self.every_s = every_s
        self._last = float("-inf")

    def __call__(self, done: int, total: int, elapsed_s: float) -> None:
        import time

        now = time.monotonic()
        if not self.tty and done < total and now - self._last < self.every_s:
            return
        self._last = now
        line = f"eval: {done}/{total} episodes done, {elapsed_s:.0f} s elapsed"
        if 0 < done < total:
            line += f", about {elapsed_s / done * (total - done):.0f} s to go"
        if self.tty:
            sys.stderr.write("\r" + line + ("\n" if done >= total else ""))
        else:
            sys.stderr.write(line + "\n")
        sys.stderr.flush()


def cmd_eval(ns: argparse.Namespace) -> int:
    from agentrl.orchestration.evaluate import run_eval

    if not ns.args:
        print(_job_usage("eval"), file=sys.stderr)
        return EXIT_USAGE
    cfg = _load(ns.args)
    _log_to_console()  # server start-up and the like, while nothing else shows
    report = run_eval(cfg, progress=_EvalProgressLine())
    print(report.summary())
    print(f"report: {report.output_dir}/report.json   trajectories: {report.output_dir}/trajectories.jsonl   "
          f"look: agentrl view {report.output_dir}")
    return 0


def cmd_serve(ns: argparse.Namespace) -> int:
    import os
    import signal
    import threading

    from agentrl.inference.protocol import SERVER_TOKEN_ENV
    from agentrl.inference.serve import serve_from_config

    cfg = _load(ns.args)
    print(f"starting {cfg.inference.num_servers} {cfg.inference.engine} server(s) for {cfg.model.path} ...",
          flush=True)
    # Servers for other processes: they take the token of this environment, if it has one.
    token = os.environ.get(SERVER_TOKEN_ENV) or None
    service = serve_from_config(cfg, log_dir=ns.log_dir, token=token)
    try:
        for url in service.urls:
            print(f"serving {cfg.model.path} at {url}  (token in/out API: POST {url}/generate)", flush=True)
        print(f"every route but /health needs the bearer token in {SERVER_TOKEN_ENV}; set it where the clients "
              "run too" if token else f"no token: anyone who reaches the port can use it (set {SERVER_TOKEN_ENV} "
              "before 'agentrl serve' and where the clients run to require one)", flush=True)
        print("press Ctrl-C to stop", flush=True)
        stop = threading.Event()
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        while not stop.wait(1.0):
            if any(not s.alive for s in service.servers):
                print("a server process exited; stopping the others (see its log)", file=sys.stderr)
                return EXIT_ERROR
    except KeyboardInterrupt:
        pass
    finally:
        service.stop()
    return 0


def cmd_gateway(ns: argparse.Namespace) -> int:
    from agentrl.orchestration.gateway_service import serve_gateway_service

    cfg = _load(ns.args)
    _log_to_console()
    return serve_gateway_service(cfg, host=ns.host, port=ns.port, out=ns.out, idle_timeout_s=ns.idle_timeout or None)


def cmd_config(ns: argparse.Namespace) -> int:
    from agentrl.config import REQUIRED, config_fields, list_presets

    if ns.presets:
        for name in list_presets():
            print(name)
        return 0
    rows = config_fields()
    if ns.section:
        rows = [r for r in rows if r[0].startswith(ns.section + ".")]
        if not rows:
            from agentrl.config import AgentRLConfig
            from agentrl.errors import UnknownNameError
            from agentrl.registry import closest_names

            sections = list(AgentRLConfig.model_fields)
            close = closest_names(ns.section, sections)
            hint = f" Did you mean '{close[0]}'?" if close else ""
            raise UnknownNameError(f"No config section '{ns.section}'.{hint} Sections: {', '.join(sections)}.")
    for dotted, type_name, default, doc in rows:
        print(f"{dotted} ({type_name}, {'required' if default is REQUIRED else f'default {default!r}'})")
        for line in doc.splitlines():
            print(f"    {line.strip()}")
    return 0


def _print_registry(kind: str) -> int:
    from agentrl.registry import REGISTRIES

    reg = REGISTRIES[kind]
    if not len(reg):
        print(f"(no {reg.kind}s registered yet)")
        return 0
    width = max(len(n) for n in reg.names())
    for entry in reg.entries():
        print(f"{entry.name:<{width}}  {entry.description}")
    return 0


def cmd_sandbox(ns: argparse.Namespace) -> int:
    if ns.sandbox_command == "list":
        return _print_registry("sandbox")
    if ns.sandbox_command == "serve":
        import importlib
        import os

        try:
            server = importlib.import_module("agentrl.sandboxes.server")
        except ModuleNotFoundError:
            return cmd_not_built("sandbox serve", "the sandbox server (agentrl.sandboxes.server)", "")
        token = ns.token or os.environ.get("AGENTRL_SANDBOX_TOKEN")
        kwargs: dict[str, Any] = {"host": ns.host, "port": ns.port, "token": token, "backend": ns.backend}
        if ns.max_concurrency:
            kwargs["max_concurrency"] = ns.max_concurrency
        server.serve(**kwargs)
        return 0
    print("usage: agentrl sandbox {list,serve} ...", file=sys.stderr)
    return EXIT_USAGE


def cmd_swe(ns: argparse.Namespace) -> int:
    if ns.swe_command not in ("convert", "check"):
        print("usage: agentrl swe {convert,check} ...", file=sys.stderr)
        return EXIT_USAGE
    import json
    from pathlib import Path

    from agentrl.envs.swe_formats import FORMATS
    from agentrl.envs.swe_tasks import load_tasks, tasks_rows

    if ns.format not in ("auto", *FORMATS):
        print(f"agentrl swe {ns.swe_command}: --format {ns.format!r} is none of auto, {', '.join(FORMATS)}",
              file=sys.stderr)
        return EXIT_USAGE
    tasks = load_tasks(ns.instances, format=ns.format, image_namespace=ns.image_namespace)
    if ns.swe_command == "convert":
        with Path(ns.rows).open("w") as f:
            for row in tasks_rows(tasks):
                f.write(json.dumps(row) + "\n")
        print(f"{len(tasks)} instances -> {ns.rows}")
        return 0
    from dataclasses import asdict

    from agentrl.envs.swe_check import check_tasks

    results = check_tasks(tasks[: ns.limit], sandbox=ns.sandbox, concurrency=ns.concurrency)
    for r in results:
        line = f"ok      {r.instance_id}" if r.ok else f"BROKEN  {r.instance_id}: {r.problem}"
        print(line + (f" ({r.detail})" if r.detail and not r.ok else "") + f"  [{r.seconds:.0f} s]")
    broken = [r for r in results if not r.ok]
    print(f"{len(results)} instances: {len(results) - len(broken)} ok, {len(broken)} broken")
    if ns.report is not None:
        Path(ns.report).write_text(json.dumps([asdict(r) for r in results], indent=2))
    return EXIT_ERROR if broken else 0


def cmd_envs(ns: argparse.Namespace) -> int:
    if ns.envs_command == "list":
        return _print_registry("env")
    print("usage: agentrl envs list", file=sys.stderr)
    return EXIT_USAGE


def cmd_tools(ns: argparse.Namespace) -> int:
    if ns.tools_command == "list":
        return _print_registry("tool")
    if ns.tools_command == "parsers":
        return _print_registry("tool_parser")
    print("usage: agentrl tools {list,parsers}", file=sys.stderr)
    return EXIT_USAGE


def cmd_check(ns: argparse.Namespace) -> int:
    if ns.check_command != "onpolicy":
        print("usage: agentrl check onpolicy [CONFIG] key=value ... [--rows N] [--json]", file=sys.stderr)
        return EXIT_USAGE
    from agentrl.orchestration.onpolicy_check import run_onpolicy_check

    report = run_onpolicy_check(_load(ns.args), rows=ns.rows, bf16_vs_fp32=not ns.no_dtype,
                                placement=not ns.no_placement)
    print(report.to_json() if ns.json else report.text())
    return 0 if report.passed else EXIT_ERROR


def cmd_version(ns: argparse.Namespace) -> int:
    from agentrl import __version__

    print(f"agentrl {__version__}")
    return 0


_COMMANDS = {
    "run": cmd_run,
    "eval": cmd_eval,
    "sft": cmd_offline,
    "dpo": cmd_offline,
    "plot": cmd_plot,
    "view": cmd_view,
    "serve": cmd_serve,
    "gateway": cmd_gateway,
    "validate": cmd_validate,
    "doctor": cmd_doctor,
    "config": cmd_config,
    "sandbox": cmd_sandbox,
    "swe": cmd_swe,
    "envs": cmd_envs,
    "tools": cmd_tools,
    "check": cmd_check,
    "version": cmd_version,
}


def _take_ctrl_c() -> None:
    """Ctrl-C (SIGINT) stops every command, also one started as a script's background job, for which
    the shell ignores SIGINT and Python, seeing it ignored, installs no KeyboardInterrupt of its own
    (`agentrl view` then could not be stopped but by a kill). `agentrl run` sets its own handler."""
    import signal
    import threading

    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `agentrl` console script; returns the exit status."""
    parser = build_parser()
    ns = parser.parse_args(argv)
    if ns.command is None:
        parser.print_help()
        return EXIT_USAGE
    from agentrl.errors import AgentRLError, ConfigError, FeatureUnavailableError

    _take_ctrl_c()
    try:
        return _COMMANDS[ns.command](ns)
    except FeatureUnavailableError as exc:
        print(f"agentrl {ns.command}: {exc}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    except ConfigError as exc:
        print(f"agentrl {ns.command}: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except AgentRLError as exc:
        print(f"agentrl {ns.command}: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except BrokenPipeError:  # output piped into `head` and the like
        sys.stderr.close()
        return 0
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
