"""Overlapped rollouts: the example job with `max_staleness: 0` and `1`, side by side in one run.

With `max_staleness: 1` the next step's rollouts (and their teacher scores) run while the learner
trains, one weight version behind. This reports each setting's median step time and samples/s
(step 1 excluded: it pays one-off warm-up, and cannot overlap) and their ratio, plus how much of a
step the learner then still waits for rollouts. On a CPU box every role shares the same cores, so
overlap can only win what the roles leave idle; on GPUs the roles run on different devices.

Launch: `.venv/bin/python benchmarks/staleness.py --steps 8` (after `opd make-tiny-models`).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from harness import EXAMPLE_JOB, job_spec, run_job, write_json


def measure(job_file: Path, steps: int, max_staleness: int) -> dict[str, Any]:
    spec = job_spec(job_file, max_steps=steps, eval_steps=10**6, max_staleness=max_staleness)
    spec = spec.model_copy(update={"validation_datasets": []})
    run = run_job(spec)
    measured = run.train[1:]
    return {
        "max_staleness": max_staleness,
        "steps_measured": len(measured),
        "step_s": statistics.median(r["time/step_s"] for r in measured),
        "samples_per_s": statistics.median(r["rollouts"] / r["time/step_s"] for r in measured),
        "rollout_wait_s": statistics.median(r["time/rollout_s"] for r in measured),
        "teacher_wait_s": statistics.median(r["time/teacher_s"] for r in measured),
        "learner_s": statistics.median(r["time/learner_s"] for r in measured),
        "staleness_mean": statistics.mean(r["staleness/mean"] for r in measured),
        "final_reverse_kl": run.train[-1]["reverse_kl"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--job", type=Path, default=EXAMPLE_JOB)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/staleness.json"))
    args = parser.parse_args()
    on_policy = measure(args.job, args.steps, 0)
    overlapped = measure(args.job, args.steps, 1)
    result = {
        "on_policy": on_policy,
        "overlapped": overlapped,
        "samples_per_s_ratio": overlapped["samples_per_s"] / on_policy["samples_per_s"],
    }
    print(f"{'max_staleness':<15}{'step s':>9}{'samples/s':>11}{'rollout wait s':>16}{'learner s':>11}")
    for row in (on_policy, overlapped):
        print(
            f"{row['max_staleness']:<15}{row['step_s']:>9.2f}{row['samples_per_s']:>11.2f}"
            f"{row['rollout_wait_s']:>16.2f}{row['learner_s']:>11.2f}"
        )
    print(f"samples/s, max_staleness 1 / 0: {result['samples_per_s_ratio']:.2f}x")
    write_json(args.out, result)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
