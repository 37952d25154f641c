"""Job start-up: from submitting a job to its first training step, split at the driver's events.

One run starts a fresh local Ray in this process, submits the example job (`examples/model_opd_tiny/
job.yaml`, `--steps` steps, checkpoints only at the end) to a `JobDriverActor` exactly as `opd train`
does, and reads its events (events.jsonl, wall-clock times) once it ends:

- `submit_to_first_step_s`: the actor's creation to the first step's record (what a user waits for);
- `submit_to_training_s`: to the 'training N steps' status (pre-flight, the engines, learner, gateways and
  pools started, the weights handed to the engines, the baseline validation done);
- `first_step_s`: from that status to the first step's record (a cold step: first compilation, first
  pool workers).

Figures (records.py, via `repeat.py job_startup` or `before_after.py job_startup`): the three above.
Ray's own start is outside the clock (it is started before the submit, as a server's Ray is).
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from harness import EXAMPLE_JOB, job_spec, write_json


def measure(job_file: Path, steps: int) -> dict[str, Any]:
    import ray

    from opd_trainer.cluster.ray_runtime import init_ray
    from opd_trainer.driver.job_driver import JobDriverActor
    from opd_trainer.jsonl import read_jsonl

    spec = job_spec(job_file, max_steps=steps)
    run_dir = Path(tempfile.mkdtemp(prefix="opd-startup-"))
    init_ray()
    submitted = time.time()
    driver = JobDriverActor.options(num_cpus=0).remote(spec, str(run_dir.resolve()))  # type: ignore[attr-defined]
    try:
        ray.get(driver.run.remote())
    finally:
        ray.kill(driver)
    events = read_jsonl(run_dir / "events.jsonl")  # the lines as written: the same on either side of a change
    shutil.rmtree(run_dir, ignore_errors=True)
    training = next(e for e in events if e["type"] == "status" and e["message"].startswith("training "))
    first = next(e for e in events if e["type"] == "step")
    return {
        "settings": {"job": str(job_file), "steps": steps},
        "submit_to_first_step_s": first["time"] - submitted,
        "submit_to_training_s": training["time"] - submitted,
        "first_step_s": first["time"] - training["time"],
        "statuses": [
            {"s": e["time"] - submitted, "message": e["message"]} for e in events if e["type"] == "status"
        ],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--job", type=Path, default=EXAMPLE_JOB)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/job_startup.json"))
    args = parser.parse_args()
    result = measure(args.job, args.steps)
    for status in result["statuses"]:
        print(f"{status['s']:8.1f} s  {status['message']}")
    print(
        f"submit -> first step {result['submit_to_first_step_s']:.1f} s "
        f"(to training {result['submit_to_training_s']:.1f} s, first step {result['first_step_s']:.1f} s)"
    )
    write_json(args.out, result)


if __name__ == "__main__":
    main()
