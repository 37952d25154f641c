"""A change's before/after figures: a one-sided benchmark run against the product code of an earlier
commit and of this checkout, alternating, each run a fresh process, written as one record (records.py).

For the benchmarks `repeat.py` reads (its `FIGURES`): per pair, this checkout's `benchmarks/<name>.py`
runs first with the code of `--before` (a git worktree of that commit under `.cache/before-after/`) and
then with this checkout's; the measurement is the same script on both sides, only the code measured
differs. The record holds every run's JSON and, per figure, `<figure>/before`, `<figure>/after` and
`<figure>/ratio` (after / before of each pair: below 1 where the figure fell), median and range.

    .venv/bin/python benchmarks/before_after.py learner_step --before 53560de --publish

Each side imports its own `opd_trainer` (and `api`, `rollout_workers`, `reward_workers`): the side's
folder comes first on `PYTHONPATH` and is the working directory, so the benchmark's process and the Ray
workers it starts (they inherit its environment) load that side's files; before measuring, each side's
Ray worker reports where it found `opd_trainer`, and a side that reads another's code stops the run. The
tiny models are this checkout's (`.cache/tiny-models`, linked into the worktree), the same files on both
sides.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from records import ROOT, add_publish_arguments, new_record, write_record
from repeat import FIGURES, figures_of

HERE = Path(__file__).resolve().parent
SIDES = ("before", "after")
WORKTREES = ROOT / ".cache" / "before-after"
MODELS = Path(".cache") / "tiny-models"
# Where a Ray worker started from `root` finds `opd_trainer`: printed by the side's own interpreter.
WHERE_RAY_IMPORTS = (
    "import ray\n"
    'ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)\n'
    "@ray.remote\n"
    "def where():\n"
    "    import opd_trainer\n"
    "    return opd_trainer.__file__\n"
    "print(ray.get(where.remote()))\n"
    "ray.shutdown()\n"
)


def commit_of(revision: str) -> str:
    """The full commit `revision` names in this repository (a clear error if it names none)."""
    found = subprocess.run(
        ["git", "rev-parse", "--verify", f"{revision}^{{commit}}"], cwd=ROOT, capture_output=True, text=True
    )
    if found.returncode != 0:
        raise SystemExit(f"--before: {revision!r} names no commit here ({found.stderr.strip()})")
    return found.stdout.strip()


def worktree(commit: str) -> Path:
    """A detached worktree of `commit` (made once, reused), with this checkout's tiny models linked in."""
    path = WORKTREES / commit[:12]
    if not (path / ".git").exists():
        WORKTREES.mkdir(parents=True, exist_ok=True)
        subprocess.run(["git", "worktree", "add", "--detach", str(path), commit], cwd=ROOT, check=True)
    models = path / MODELS
    if not models.exists():
        models.parent.mkdir(parents=True, exist_ok=True)
        models.symlink_to((ROOT / MODELS).resolve(), target_is_directory=True)
    return path


def side_env(root: Path) -> dict[str, str]:
    """The environment of a run from `root`: its folder first on PYTHONPATH, the shared tiny models."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(root), env.get("PYTHONPATH", "")) if p)
    env["OPD_TINY_MODELS_DIR"] = str((ROOT / MODELS).resolve())
    return env


def check_imports_own_code(side: str, root: Path) -> None:
    """Stops unless a Ray worker started from `root` imports `root`'s `opd_trainer`."""
    found = subprocess.run(
        [sys.executable, "-c", WHERE_RAY_IMPORTS],
        cwd=root,
        env=side_env(root),
        capture_output=True,
        text=True,
        check=True,
    )
    location = Path(found.stdout.strip().splitlines()[-1]).resolve()
    if not location.is_relative_to(root.resolve()):
        raise SystemExit(f"{side}: a Ray worker imported opd_trainer from {location}, not from {root}")


def run_once(benchmark: str, root: Path, script_args: list[str]) -> dict[str, Any]:
    """One run of this checkout's `benchmarks/<benchmark>.py` with `root`'s code (a fresh process): its
    JSON."""
    with tempfile.TemporaryDirectory(prefix="opd-bench-before-after-") as scratch:
        out = Path(scratch) / "result.json"
        cmd = [sys.executable, str(HERE / f"{benchmark}.py"), *script_args, "--out", str(out)]
        subprocess.run(cmd, cwd=root, env=side_env(root), check=True)
        return json.loads(out.read_text())


def pair_figures(
    benchmark: str,
    before: list[dict[str, Any]],
    after: list[dict[str, Any]],
    names: list[str] | None = None,
) -> dict[str, list[float | None]]:
    """Per figure of `benchmark` (those in `names`, default all): each side's values and each pair's
    after / before ratio."""
    sides = {"before": figures_of(benchmark, before), "after": figures_of(benchmark, after)}
    out: dict[str, list[float | None]] = {}
    for name in names or FIGURES[benchmark]:
        was, now = sides["before"][name], sides["after"][name]
        out[f"{name}/before"], out[f"{name}/after"] = was, now
        out[f"{name}/ratio"] = [b / a if a and b is not None else None for a, b in zip(was, now, strict=True)]
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("benchmark", choices=sorted(FIGURES))
    parser.add_argument("--before", required=True, help="the commit to compare this checkout with")
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--record", default=None, help="the record's name (default: BENCHMARK_before_after)")
    parser.add_argument("--figures", nargs="*", default=[], help="the figures recorded (default: all)")
    parser.add_argument(
        "--headline", nargs="*", default=[], help="figures the record's headline names (e.g. learner_s/ratio)"
    )
    add_publish_arguments(parser)
    parser.epilog = "Arguments after `--` go to the benchmark's script, on both sides."
    argv = list(sys.argv[1:] if argv is None else argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    args = parser.parse_args(argv[:cut])
    script_args = argv[cut + 1 :]
    offered = list(FIGURES[args.benchmark])
    unknown = [name for name in args.figures if name not in offered]
    if unknown:
        raise SystemExit(f"--figures: {unknown} are not figures of {args.benchmark} (one of {offered})")
    recorded = args.figures or list(FIGURES[args.benchmark])
    known = [f"{name}/{part}" for name in recorded for part in ("before", "after", "ratio")]
    unknown = [name for name in args.headline if name not in known]
    if unknown:
        raise SystemExit(f"--headline: {unknown} are not figures recorded (one of {known})")
    commit = commit_of(args.before)
    roots = {"before": worktree(commit), "after": ROOT}
    for side in SIDES:
        check_imports_own_code(side, roots[side])
    results: dict[str, list[dict[str, Any]]] = {side: [] for side in SIDES}
    runs = []
    for pair in range(args.pairs):
        for side in SIDES:
            print(f"[before_after] pair {pair + 1}/{args.pairs}, {side}", flush=True)
            result = run_once(args.benchmark, roots[side], script_args)
            results[side].append(result)
            runs.append({"pair": pair, "side": side, "result": result})
    figures = pair_figures(args.benchmark, results["before"], results["after"], recorded)
    record = new_record(
        args.record or f"{args.benchmark}_before_after",
        {**vars(args), "before_commit": commit},
        seeds=[],
        runs=runs,
        figures=figures,
        headline=args.headline,
        notes=[
            f"{args.pairs} pairs of benchmarks/{args.benchmark}.py, before (commit {commit[:10]}) then after "
            "(this record's commit), each a fresh process",
        ],
    )
    write_record(record, publish=args.publish, results_dir=args.results_dir, published_dir=args.published_dir)
    for name, s in record.figures.items():
        print(f"{name:<44} median {s['median']}  range {s['min']}–{s['max']}  runs {s['runs']}")


if __name__ == "__main__":
    main()
