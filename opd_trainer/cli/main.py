"""`opd` command line: build the tiny models, preview a dataset, train a job, run the engine round trip,
serve and submit jobs.

Launch: `opd --help`. Every command runs on a local embedded Ray unless RAY_ADDRESS is set.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from opd_trainer.cli.arguments import positive_int
from opd_trainer.cli.client_commands import add_client_commands
from opd_trainer.cli.preview import add_preview_command
from opd_trainer.cli.serve import add_server_commands
from opd_trainer.driver.estimate import DEFAULT_CALIBRATION_STEPS

DEFAULT_MODELS_DIR = Path(".cache/tiny-models")


def _make_tiny_models(args: argparse.Namespace) -> int:
    # Lazy: CLI start-up (`opd --help`) loads no command's stack; this one loads when it runs.
    from opd_trainer.demo.tiny_models import build_tiny_models

    started = time.perf_counter()
    models = build_tiny_models(
        Path(args.dir), seed=args.seed, force=args.force, threads=args.threads, variant=args.variant
    )
    print(f"tiny models in {models.teacher.parent} ({time.perf_counter() - started:.1f}s)")
    for role in ("teacher", "student"):
        m = models.manifest[role]["validation"]
        print(
            f"  {role:<8} exact match {m['exact_match']:.1%}  decision {m['decision_accuracy']:.1%}  "
            f"format {m['format_validity']:.1%}  -> {getattr(models, role)}"
        )
    print(f"  data     {models.data_dir}")
    return 0


def _roundtrip(args: argparse.Namespace) -> int:
    # Lazy: CLI start-up (`opd --help`) loads no command's stack; this one loads when it runs.
    from opd_trainer.cluster.ray_runtime import init_ray
    from opd_trainer.demo.roundtrip import format_report, run_roundtrip
    from opd_trainer.demo.tiny_models import build_tiny_models

    models = build_tiny_models(Path(args.models_dir))
    print("starting local Ray and the student/teacher vLLM engines ...", flush=True)
    init_ray()
    report = asyncio.run(run_roundtrip(models, num_prompts=args.prompts))
    print(format_report(report))
    return 0


def _train(args: argparse.Namespace) -> int:
    # Lazy: CLI start-up (`opd --help`) loads no command's stack; this one loads when it runs.
    from opd_trainer.cli.train import run_train

    return run_train(Path(args.job_file), Path(args.run_dir) if args.run_dir else None, args.stop_after)


def _estimate(args: argparse.Namespace) -> int:
    # Lazy: CLI start-up (`opd --help`) loads no command's stack; this one loads when it runs.
    from opd_trainer.cli.train import run_estimate

    return run_estimate(Path(args.job_file), args.calibration_steps, args.output == "json", args.memory)


def _preemption_notice(args: argparse.Namespace) -> int:
    # Lazy: CLI start-up (`opd --help`) loads no command's stack; this one loads when it runs.
    from opd_trainer.cluster.preemption import notify_from_this_node

    notify_from_this_node(args.address, args.grace_s, args.reason, wait=not args.no_wait)
    return 0


def _version() -> str:
    try:
        return version("opd-trainer")
    except PackageNotFoundError:  # run from a source tree that was not installed
        return "unknown (not installed)"


def _add_train_commands(commands: Any) -> None:
    """train and estimate: a job file run (or calibrated) on a local Ray."""
    train = commands.add_parser(
        "train",
        help="run an OPD job file on a local Ray (resumes from the run directory's latest checkpoint)",
    )
    train.add_argument("job_file", help="job spec, YAML or JSON")
    train.add_argument("--run-dir", help="where metrics, checkpoints and curves go (default: runs/JOB_NAME)")
    train.add_argument("--stop-after", type=int, help="stop (with a checkpoint) after this many steps")
    train.set_defaults(handler=_train)

    estimate = commands.add_parser(
        "estimate",
        help="what a job will use: each role's memory (the plan pre-flight holds it to), then teacher "
        "tokens, CPU/GPU-seconds and wall time from a short calibration run of it on a local Ray",
    )
    estimate.add_argument("job_file", help="job spec, YAML or JSON")
    estimate.add_argument(
        "--calibration-steps",
        type=positive_int,
        default=DEFAULT_CALIBRATION_STEPS,
        help=f"training steps the calibration runs (default {DEFAULT_CALIBRATION_STEPS}; it validates "
        "after the first)",
    )
    estimate.add_argument(
        "--memory",
        action="store_true",
        help="print the memory plan per role alone (GiB by term, the budget, settings that would fit) "
        "without starting anything; exit code 2 when it does not fit",
    )
    estimate.add_argument("-o", "--output", choices=("text", "json"), default="text", help="output format")
    estimate.set_defaults(handler=_estimate)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="opd", description="Online policy distillation trainer.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    commands = parser.add_subparsers(dest="command", required=True)

    tiny = commands.add_parser(
        "make-tiny-models",
        help="build the tiny tokenizer, teacher, student and tool-routing data on disk (cached)",
    )
    tiny.add_argument("dir", help="output directory (re-running with the same seed is a cache hit)")
    tiny.add_argument("--seed", type=int, default=0, help="seed of data, tokenizer and training")
    tiny.add_argument("--force", action="store_true", help="rebuild even if the cache matches")
    tiny.add_argument(
        "--threads",
        type=positive_int,
        default=None,
        help="torch threads of the build (default: $OPD_TINY_MODELS_THREADS, else 2); part of the cache key, "
        "with torch's CPU kernel level ($ATEN_CPU_CAPABILITY), since either may change float rounding",
    )
    tiny.add_argument(
        "--variant",
        choices=["tool_routing", "self_correction", "lookup"],
        default="tool_routing",
        help="task mix: the demo's tool routing; or that plus tool errors the agent corrects in its next "
        "turn (adds the episodes of examples/self_correction_agentic to data/); or lookup chains, find_item "
        "then the call on the returned id (adds the episodes of examples/lookup_agentic)",
    )
    tiny.set_defaults(handler=_make_tiny_models)

    _add_train_commands(commands)

    roundtrip = commands.add_parser(
        "roundtrip",
        help="student samples, teacher scores the exact tokens, teacher weights synced into the student",
    )
    roundtrip.add_argument("--models-dir", default=str(DEFAULT_MODELS_DIR), help="tiny models directory")
    roundtrip.add_argument("--prompts", type=int, default=8, help="validation prompts to sample")
    roundtrip.set_defaults(handler=_roundtrip)
    notice = commands.add_parser(
        "preemption-notice",
        help="tell the jobs with parts on this Ray node that it goes away soon (a pod's preStop hook): "
        "each checkpoints at the end of its step under way, then waits out the grace",
    )
    notice.add_argument("--address", default="auto", help="Ray cluster address (default: auto)")
    notice.add_argument(
        "--grace-s", type=float, default=60.0, help="seconds until the node goes (default 60)"
    )
    notice.add_argument("--reason", default="preempted", help="why, as the jobs' events say it")
    notice.add_argument("--no-wait", action="store_true", help="return at once instead of after the grace")
    notice.set_defaults(handler=_preemption_notice)
    add_preview_command(commands)
    add_server_commands(commands)
    add_client_commands(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    return int(args.handler(args))


if __name__ == "__main__":
    sys.exit(main())
