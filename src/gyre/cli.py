"""``gyre``: train | sft | eval | verify-resume | report | serve | export | import | submit | plan.

    gyre train [CONFIG.yaml] [key=value ...]   SFT warm start (if sft.steps > 0), then GRPO
    gyre sft   [CONFIG.yaml] [key=value ...]   SFT only; writes <run.dir>/sft/
    gyre eval  [CONFIG.yaml] [key=value ...]   evaluate model.path on held-out seeds
    gyre verify-resume [CONFIG.yaml] [key=value ...]   kill -9 + resume == uninterrupted?
    gyre report RUN_DIR [--out FILE] [--watch]  HTML report of a finished or running run
    gyre serve MODEL_DIR [--host H] [--port N] [--api-key KEY]   OpenAI-compatible server
    gyre tinker-serve [--host H] [--port N] [--api-key-file F] [key=value ...]   Tinker API
    gyre export RUN_DIR --out DIR              plain Hugging Face folder (LoRA merged)
    gyre import FILE.gguf --out DIR            a GGUF checkpoint as a Hugging Face folder
    gyre submit [CONFIG.yaml] [key=value ...] --address http://HEAD:8265   run train as a Ray job
    gyre plan [RUN_DIR ...] --nodes N          where rollout and training go on N nodes

Exit codes: 0 done, 1 error, 2 config or input error (a key, a file, a dataset row: named on
one line), 3 aborted by a fault policy (faults.*, or nan/inf weights after an update), 75 stopped
on SIGTERM/SIGINT after a checkpoint (resume with run.resume=auto), 130 second signal. Errors
are one line on stderr; ``--debug`` also prints the traceback.
69: a peer (an engine server, a reward worker, a Ray actor, a collective, storage) did not
answer within its deadline: ``gyre: <kind> fault: <stage>: no answer from <peer> for N s (key)``.

With no config file, ``gyre train`` and ``gyre sft`` run the shipped maze recipe
(``gyre/recipes/maze.yaml``, the same file as examples/maze/config.yaml) unless the keys name
another ``env.name`` or a ``model.path``; then the fields' defaults. Keys are dotted config
paths, e.g. ``run.dir=runs/x train.steps=20 model.path=/models/my-llm``; ``--help-config``
lists them all with the values the recipe runs.
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from pathlib import Path
from typing import Any

from gyre.config import Config, ConfigError, describe_fields, load_config
from gyre.config.loading import default_config_path
from gyre.errors import InputError, disk_full_message, is_disk_full

_KEYS_HELP = """common keys (all of them: gyre --help-config):
  run.dir=PATH          run directory (default runs/<env>-<timestamp>)
  run.seed=N            master seed
  run.resume=auto       continue from the newest valid checkpoint (or never, or a path)
  run.overwrite=true    with run.resume=never, delete an earlier run in run.dir
  run.device=cpu        cpu, cuda, cuda:N or auto
  model.path=DIR|ID     a Hugging Face causal-LM folder or hub id (default: the tiny model)
  sft.steps=N           SFT steps before GRPO (0 skips SFT)
  train.steps=N         GRPO steps
  eval.episodes=N       held-out episodes per evaluation
  env.name=arithmetic   maze (default), arithmetic, dataset or a plug-in (docs/envs.md)"""


def _parse(argv: list[str]) -> tuple[argparse.Namespace, Config]:
    parser = argparse.ArgumentParser(
        prog="gyre",
        description="gyre: RL post-training of language models.\n\n"
        + (__doc__ or "").split("\n\n")[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Examples:\n  gyre train\n  gyre train examples/arithmetic/config.yaml "
        "train.steps=20\n  gyre train run.dir=runs/a run.resume=auto\n"
        "  gyre eval model.path=runs/a/final eval.episodes=500",
    )
    parser.add_argument(
        "--help-config",
        action="store_true",
        help="list every config key with the value `gyre train` uses (the maze recipe)",
    )
    parser.add_argument(
        "--debug", action="store_true", help="on an error, also print the traceback"
    )
    sub = parser.add_subparsers(
        dest="command",
        metavar="{train,sft,eval,verify-resume,report,plan,submit,serve,export,import,"
        "tinker-serve}",
    )
    helps = {
        "train": "SFT warm start (if sft.steps > 0) then GRPO; the default runs the maze demo",
        "sft": "supervised warm start only; writes <run.dir>/sft/",
        "eval": "greedy and sampled success of model.path on held-out seeds",
        "verify-resume": "run a config straight and SIGKILLed + resumed N times; check both "
        "end bit-identical (docs/operations.md)",
    }
    for name, text in helps.items():
        p = sub.add_parser(
            name,
            help=text,
            description=text + ".",
            epilog=_KEYS_HELP,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        p.add_argument("args", nargs="*", metavar="[CONFIG.yaml] [key=value ...]")
        if name == "verify-resume":
            p.add_argument("--kills", type=int, default=5, help="SIGKILLs (default 5)")
            p.add_argument("--seed", type=int, default=0, help="seed of the kill moments")
            p.add_argument("--workdir", default="", help="where both runs go (default: a temp dir)")
    sub.add_parser("report", help="HTML report of a run: gyre report RUN_DIR [--out] [--watch]")
    sub.add_parser("plan", help="placement planner: gyre plan [RUN_DIR ...] --nodes N")
    _add_submit(sub)
    # dispatched before this parser (their own flags); listed here so that --help names them
    sub.add_parser("serve", help="serve a model over HTTP: gyre serve --help")
    sub.add_parser("export", help="export a run's weights: gyre export --help")
    sub.add_parser("import", help="a GGUF file as a Hugging Face folder: gyre import --help")
    sub.add_parser(
        "tinker-serve", help="the Tinker API for the official SDK: gyre tinker-serve --help"
    )
    ns = parser.parse_args(argv)
    if ns.help_config:
        print("\n".join(describe_fields()))
        sys.exit(0)
    if ns.command is None:
        parser.print_help()
        sys.exit(2)
    args = list(ns.args)
    path = None
    if args and "=" not in args[0]:
        path = args.pop(0)
    elif ns.command in ("train", "sft"):
        path = default_config_path(args)
        if path is not None:  # stdout: stderr is for errors
            print(f"gyre: no config file: the maze recipe {path} (gyre --help-config)", flush=True)
    return ns, load_config(path, args)


def _add_submit(sub: Any) -> None:
    text = "submit `gyre train` to a Ray cluster through the Ray Jobs API (needs gyre[ray])"
    p = sub.add_parser(
        "submit",
        help=text,
        description=text + ".",
        allow_abbrev=False,  # `--token X` must not pass for --token-file: no token in argv
        epilog=_KEYS_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("args", nargs="*", metavar="[CONFIG.yaml] [key=value ...]")
    p.add_argument("--address", required=True, help="Ray dashboard address, http://HEAD:8265")
    p.add_argument("--working-dir", default=".", help="uploaded as the job's working dir")
    p.add_argument("--pip", action="append", default=[], help="pip package for the job's env")
    p.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="environment variable for the job",
    )
    p.add_argument("--python", default="python", help="interpreter on the cluster")
    p.add_argument("--no-follow", action="store_true", help="return after submitting")
    p.add_argument(
        "--token-file",
        help="file holding the cluster's Ray auth token (else RAY_AUTH_TOKEN, "
        "RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token)",
    )


def _submit(ns: argparse.Namespace) -> int:
    from gyre.runners.submit import JobRuntime, SubmitError, submit

    args = list(ns.args)
    config = args.pop(0) if args and "=" not in args[0] else None
    env = dict(e.split("=", 1) for e in ns.env)
    runtime = JobRuntime(ns.working_dir, ns.pip, env, ns.python)
    try:
        job_id, status = submit(
            ns.address, config, args, runtime, follow=not ns.no_follow, token_file=ns.token_file
        )
    except SubmitError as exc:
        print(f"gyre submit: {exc}", file=sys.stderr)
        return 2
    print(f"job {job_id}: {status}")
    return 0 if status in ("SUCCEEDED", "PENDING", "RUNNING") else 1


def _cell(e: dict, key: str, fmt: str) -> str:
    return fmt.format(e[key]) if key in e else "-"


def _table(rows: list[tuple[str, dict]], env_success: bool = True) -> str:
    """The held-out results. ``env_success=False`` (reward functions with ``env_weight: 0``):
    the env's own success is no part of the run's reward, so the table shows the reward the
    run trains on, greedy and sampled, instead of it."""
    from rich.table import Table

    t = Table(title="held-out evaluation")
    if env_success:
        cols = {
            "greedy success": ("eval/success_greedy", "{:.1%}"),
            "sampled success": ("eval/success_sampled", "{:.1%}"),  # none for the demonstrator
            "mean reward (greedy)": ("eval/reward_greedy", "{:.3f}"),
            "mean moves (greedy)": ("eval/moves_greedy", "{:.2f}"),
        }
    else:
        cols = {
            "mean reward (greedy)": ("eval/reward_greedy", "{:.3f}"),
            "mean reward (sampled)": ("eval/reward_sampled", "{:.3f}"),
        }
    t.add_column("policy")
    for col in cols:
        t.add_column(col)
    for name, e in rows:
        t.add_row(name, *(_cell(e, key, fmt) for key, fmt in cols.values()))
    return t


def main(argv: list[str] | None = None) -> int:
    """Run one command; every error becomes one line on stderr and an exit code (module doc).

    ``--debug`` (anywhere on the line) also prints the traceback.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    argv = [a for a in argv if a != "--debug"]
    try:
        return _run(argv)
    except Exception as exc:  # the one place errors become exit codes
        if debug:
            traceback.print_exc()
        line, code = _error_line(exc)
        print(line, file=sys.stderr)
        return code


def _error_line(exc: Exception) -> tuple[str, int]:
    """(the stderr line, the exit code) of an error that ended a command."""
    from gyre.checkpoint.resume import EXIT_FAULTS, EXIT_PREEMPTED, FaultAbort, Preempted
    from gyre.checkpoint.store import CheckpointError
    from gyre.deadlines import EXIT_PEER, BadAnswer, PeerFault

    cause = getattr(exc, "cause", None)  # raised in a Ray actor: the actor's error, not Ray's
    if isinstance(cause, Exception) and type(exc).__name__.startswith("RayTaskError"):
        exc = cause
    if isinstance(exc, ConfigError):
        return f"gyre: config error: {exc}", 2
    if isinstance(exc, InputError):
        return f"gyre: error: {exc}", 2
    if isinstance(exc, Preempted):
        return f"gyre: {exc}", EXIT_PREEMPTED
    if isinstance(exc, FaultAbort):
        return f"gyre: aborted: {exc}", EXIT_FAULTS
    if isinstance(exc, PeerFault):
        return f"gyre: {exc}", EXIT_PEER
    if isinstance(exc, BadAnswer):
        return f"gyre: {exc.kind} fault: {exc}", EXIT_PEER
    if isinstance(exc, OSError) and is_disk_full(exc):
        return f"gyre: error: {disk_full_message(exc.filename or '(unnamed file)')}", 1
    if isinstance(exc, FileNotFoundError | FileExistsError | ValueError | CheckpointError):
        return f"gyre: error: {exc}", 1
    if isinstance(exc, ImportError):
        return f"gyre: error: {exc}", 1
    if isinstance(exc, OSError):
        where = f" ({exc.filename})" if exc.filename else ""
        return f"gyre: error: {exc.strerror or exc}{where}", 1
    first = (str(exc).strip().splitlines() or [""])[0]
    return f"gyre: internal error: {type(exc).__name__}: {first} (--debug shows the traceback)", 1


def _run(argv: list[str]) -> int:
    if argv[:1] == ["plan"]:  # placement planner: a run dir and figures, its own parser
        from gyre.commands.plan import main as plan_main

        return plan_main(argv[1:])
    if argv[:1] == ["report"]:  # takes a run dir, not config keys: its own parser
        from gyre.telemetry.report import main as report_main

        return report_main(argv[1:])
    if argv[:1] == ["tinker-serve"]:  # the Tinker API for the official SDK (docs/tinker.md)
        from gyre.tinker.server import main as tinker_main

        return tinker_main(argv[1:])
    if argv and argv[0] in ("serve", "export", "import"):  # paths and flags, not config keys
        from gyre.commands import export, import_gguf
        from gyre.serve import server

        mains = {"serve": server.main, "export": export.main, "import": import_gguf.main}
        return mains[argv[0]](argv[1:])
    ns, cfg = _parse(argv)
    from rich.console import Console

    console = Console()
    from gyre import loop

    if ns.command in ("train", "eval"):
        from gyre.envs.record import adopt_recorded_env

        try:
            note = adopt_recorded_env(cfg)
        except ValueError as exc:
            print(f"gyre: error: {exc}", file=sys.stderr)
            return 1
        if note:
            print(f"gyre: {note}", flush=True)  # stdout: stderr is for errors

    if ns.command == "verify-resume":
        from gyre.commands.verify_resume import verify_resume

        raw = list(ns.args)
        report = verify_resume(
            raw, ns.kills, ns.seed, Path(ns.workdir) if ns.workdir else None, echo=True
        )
        print(report.summary())
        return 0 if report.ok else 1
    if ns.command == "submit":
        return _submit(ns)
    if ns.command == "train":
        from gyre.runners import train

        s = train(cfg)
        scored_by_env = cfg.reward.env_success_scored
        rows = [("demonstrator", s["demonstrator"])] if s.get("demonstrator") else []
        rows += [("before GRPO", s["before"]), ("after GRPO", s["after"])]
        if s.get("selected") and s["selected"]["step"] != s["steps"]:
            rows[-1] = (f"after GRPO (step {s['selected']['step']}, by validation)", s["after"])
            rows.append(("last step", s["last"]))
        if s["before"] or s["after"]:
            console.print(_table(rows, scored_by_env))
        elif cfg.train.source:  # the recorded agent's tasks are not gyre's to evaluate
            console.print("no held-out evaluation (train.source: recorded episodes)")
        else:
            console.print("no held-out evaluation (eval.episodes=0)")
        console.print(f"run dir: {s['run_dir']}  wall time: {s['wall_s']:.0f}s")
    elif ns.command == "sft":
        run_dir, device = loop.setup(cfg)
        from gyre.sft import run_sft

        out = run_sft(cfg, run_dir, device, loop.base_model_path(cfg, run_dir))
        console.print(f"SFT checkpoint written to {out}")
    elif ns.command == "eval":
        return _eval(cfg, console)
    return 0


def _eval(cfg: Config, console: Any) -> int:
    if not cfg.model.path:
        print("gyre: eval needs model.path=<a Hugging Face folder>", file=sys.stderr)
        return 2
    from gyre import loop
    from gyre.checkpoint.files import check_manifest
    from gyre.models.hub import resolve_model_path

    folder = resolve_model_path(cfg.model.path)
    check_manifest(folder)  # a gyre-written folder must match its manifest
    run_dir, device = loop.setup(cfg)
    from gyre.engines.factory import run_torch_engine
    from gyre.models.build import load_pretrained
    from gyre.rollout import Rollout

    model, tok = load_pretrained(folder, device)
    engine = run_torch_engine(cfg, model, tok)
    res = Rollout(cfg, engine, tok).evaluate()
    (run_dir / "eval.json").write_text(json.dumps(res, indent=2))
    console.print(_table([(cfg.model.path, res)], cfg.reward.env_success_scored))
    return 0


if __name__ == "__main__":
    sys.exit(main())
