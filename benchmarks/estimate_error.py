"""How far `opd estimate` falls from what the job then uses.

Runs `opd estimate JOB -o json` (a calibration of `--calibration-steps` steps) and then the whole job
(`opd train JOB`), each a fresh process, and compares the estimate with the job's metered usage
(`usage.json`, `opd_trainer/driver/metering.py`): the relative error `(estimate - actual) / actual` of
teacher tokens, student tokens generated, learner tokens trained, CPU-seconds and wall time. Writes
the run's JSON to `--out`; `benchmarks/repeat.py estimate_error` repeats it into a record.

    .venv/bin/python benchmarks/estimate_error.py --job examples/model_opd_tiny/job.yaml --out /tmp/e.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OPD = [sys.executable, "-m", "opd_trainer.cli.main"]
COMPARED = ("teacher_tokens", "student_generated_tokens", "learner_tokens_trained", "cpu_s", "wall_s")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--job", default="examples/model_opd_tiny/job.yaml", help="job file to estimate and run"
    )
    parser.add_argument("--calibration-steps", type=int, default=2)
    parser.add_argument("--out", required=True, help="where the run's JSON goes")
    args = parser.parse_args(argv)
    estimate = json.loads(
        subprocess.run(
            [*OPD, "estimate", args.job, "--calibration-steps", str(args.calibration_steps), "-o", "json"],
            cwd=ROOT,
            check=True,
            capture_output=True,
            text=True,
        ).stdout
    )
    with tempfile.TemporaryDirectory(prefix="estimate-error-") as scratch:
        run_dir = Path(scratch) / "run"
        subprocess.run([*OPD, "train", args.job, "--run-dir", str(run_dir)], cwd=ROOT, check=True)
        actual = json.loads((run_dir / "usage.json").read_text())
    errors = {
        key: (estimate["usage"][key] - actual[key]) / actual[key] for key in COMPARED if actual.get(key)
    }
    result = {
        "job": args.job,
        "calibration_steps": args.calibration_steps,
        "estimate": estimate,
        "actual": {key: actual[key] for key in COMPARED},
        "relative_error": errors,
    }
    Path(args.out).write_text(json.dumps(result, indent=2))
    for key, error in errors.items():
        print(
            f"{key:<28} estimate {estimate['usage'][key]:>12,.0f}  actual {actual[key]:>12,.0f}  {error:+.1%}"
        )


if __name__ == "__main__":
    main()
