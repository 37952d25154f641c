"""Chaos: the example job with one of its parts SIGKILLed every ~10 steps, against the same job undisturbed.

Two arms, run in turn, each run a fresh process with its own local Ray (interleave.py): `calm` (the
example job `examples/model_opd_tiny/job.yaml`, `--steps` steps, its own seed) and `chaos` (the same
job, with a part of it killed by SIGKILL, what an OOM kill or a crashed CUDA context looks like, every
`--every` steps). In the chaos arm a thread of the benchmark's process kills, once the job has recorded
training step t_i, the process of one part, chosen at random with the run's seed among the student
engine (whose first replica also hosts the recording gateways), the teacher engine and the learner
rank: the parts in a seeded random order, each once in every three kills. Fault i is due after step
`i * every - every // 2` moved by a seeded -every//4 .. +every//4 (40 steps, every 10: after ~5, ~15,
~25 and ~35), so that no kill lands in a validation (every `eval_steps` = 10 steps) and every kill is
followed by steps to measure; the kill itself lands in the next step (its rollouts, scoring or
update). Kill i is made only once the job has recovered from kill i-1. The chaos job's
`resources.max_recoveries` is the number of kills, so any recovery beyond them fails it.

Measured per chaos run: whether the job succeeded, and per recovery, from the run's events
(events.jsonl, wall-clock times): the last step recorded before the fault (step s at t_s), the recovery
event (t_r), the 'training N steps' status after it (t_t: the parts started again and resumed), the
first step recorded after it (t_f) and the step s + 1 recorded after it (t_p: the job is past where it
was; a learner rank lost resumes from an older checkpoint and redoes the steps in between). Time lost
is `t_p - t_s` minus one undisturbed step: had there been no fault, step s + 1 would have been
recorded one step after t_s. One step is the median interval between consecutive step records of the
same chaos run with no fault between them (this machine's load swings within minutes, so the run's own
steps are the fairer measure of a step at that time; `time_lost_ratio_vs_calm_run` uses the median
step of the same seed's calm run instead). The component start is `t_t - t_r` (stopping what is left,
starting the parts, loading the checkpoint and publishing its weights; a restart from the start also
runs the pre-flight and the first validations again). The ratio is time lost over (one step +
component start): <= 1 means a recovery costs at most the step under way and the parts' start.
`resume_gap_s` is the narrower `t_f - t_s` minus one step (equal to time lost unless steps are
redone). Quality: the final validation exact match (the job's last validation, 'student after') of
every run; per seed chaos minus calm.

Figures (records.py; record `chaos`): `succeeded` (per chaos run, 1 or 0), `time_lost_ratio` (per
recovery; and per killed part, `/student`, `/teacher`, `/learner`), `time_lost_s`, `resume_gap_s`,
`component_start_s`, `steps_redone`, `time_lost_ratio_vs_calm_run` (per recovery), `step_s/calm`,
`step_s/chaos` (per run), `first_step_s/start` (per run: a fresh job's first step, from its 'training
N steps' status to its record) against `first_step_s/recovery` (per recovery: the same after the
restart), `final_exact_match/calm`, `final_exact_match/chaos` (per run) and
`final_exact_match_diff` (per seed, chaos minus calm).

Launch: `.venv/bin/python benchmarks/chaos.py --seeds 0 1 2 --publish` (after `opd make-tiny-models`);
`--steps 12` for a quick trial (one kill). `--save-steps` (default 20, the example job's) sets how
often the job checkpoints; a lost learner rank resumes from the latest checkpoint.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from harness import EXAMPLE_JOB, job_spec, write_json
from interleave import run_child, write_one_run
from records import add_publish_arguments, new_record, write_record

if TYPE_CHECKING:
    from opd_trainer.wire.driver import DriverEvent

SCRIPT = Path(__file__).resolve()
ARMS = ("calm", "chaos")
# The parts a fault may kill, by the driver's names for them (`JobDriver._held_actors`), and short names.
PARTS = {
    "student engine replica 0": "student",
    "teacher engine replica 0": "teacher",
    "learner rank 0": "learner",
}
POLL_S = 0.2
RUN_TIMEOUT_S = 3600.0  # one run's process, start-up and every recovery included
PID_TIMEOUT_S = 60.0


def fault_plan(seed: int, steps: int, every: int) -> list[tuple[int, str]]:
    """(the training step after which to kill, the part to kill), in order: one fault every `every`
    steps, each near the middle of its stretch of `every` steps, the parts in a seeded random order
    (each once in every len(PARTS) kills). Faults due after the job's second-to-last step are left out."""
    rng = random.Random(seed)
    jitter = every // 4
    plan: list[tuple[int, str]] = []
    order: list[str] = []
    for i in range(1, steps // every + 2):
        after = i * every - every // 2 + rng.randint(-jitter, jitter)
        if not order:
            order = rng.sample(list(PARTS), len(PARTS))
        part = order.pop()
        if 1 <= after < steps - 1:
            plan.append((after, part))
    return plan


def chaos_spec(job_file: Path, steps: int, seed: int, save_steps: int, max_recoveries: int | None) -> Any:
    """The example job at `steps` steps and `seed`, checkpointing every `save_steps` steps;
    `max_recoveries` None keeps the default."""
    spec = job_spec(job_file, max_steps=steps, seed=seed)
    data = spec.model_dump()
    data["hyper_parameters"]["save_steps"] = save_steps
    if max_recoveries is not None:
        data["resources"]["max_recoveries"] = max_recoveries
    return type(spec).model_validate(data)


def _pid_of(driver: Any, part: str) -> int:
    """The process id of the job part the driver calls `part` (as tests/integration/test_recovery.py)."""
    import ray

    held = ray.get(driver.__ray_call__.remote(lambda d: d._held_actors()), timeout=PID_TIMEOUT_S)
    return int(ray.get(held[part].__ray_call__.remote(lambda _: os.getpid()), timeout=PID_TIMEOUT_S))


class Faults(threading.Thread):
    """Kills plan[i]'s part with SIGKILL once the job has recovered from every earlier kill and
    recorded training step plan[i][0]; each kill (part, step it was due after, pid, time) in `killed`."""

    def __init__(self, driver: Any, run_dir: Path, plan: list[tuple[int, str]]) -> None:
        super().__init__(daemon=True)
        self.driver, self.run_dir, self.plan = driver, run_dir, plan
        self.killed: list[dict[str, Any]] = []
        self.done = threading.Event()

    def run(self) -> None:
        from opd_trainer.driver.recovery import RecoveryLog
        from opd_trainer.storage.run_dir import RunDir

        recoveries, log = RecoveryLog(self.run_dir), RunDir(self.run_dir)
        while not self.done.is_set() and len(self.killed) < len(self.plan):
            after, part = self.plan[len(self.killed)]
            steps = [r["step"] for r in log.records() if r["kind"] == "train"]
            if len(recoveries.entries()) >= len(self.killed) and steps and max(steps) >= after:
                try:
                    pid = _pid_of(self.driver, part)
                    os.kill(pid, signal.SIGKILL)
                except Exception:  # the parts are restarting, or the call timed out: ask again
                    time.sleep(POLL_S)
                    continue
                self.killed.append(
                    {
                        "part": PARTS[part],
                        "after_step": after,
                        "seen_step": max(steps),
                        "pid": pid,
                        "time": time.time(),
                    }
                )
                print(f"[chaos] killed {part} (pid {pid}) after step {max(steps)}", flush=True)
            time.sleep(POLL_S)


def step_intervals(events: list[DriverEvent]) -> list[float]:
    """Seconds between consecutive step records (step k-1, then k) with no recovery between them."""
    out, previous = [], None
    for event in events:
        if event.type == "recovery":
            previous = None
        elif event.type == "step":
            step = event.data["step"]
            if previous is not None and step == previous[0] + 1:
                out.append(event.time - previous[1])
            previous = (step, event.time)
    return out


def recoveries_of(events: list[DriverEvent], kills: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each recovery's raw times (seconds, see the module's docstring), in order."""
    out = []
    indices = [i for i, e in enumerate(events) if e.type == "recovery"]
    for n, index in enumerate(indices):
        event = events[index]
        step, until = event.data["step"], (indices[n + 1] if n + 1 < len(indices) else len(events))
        before = [e for e in events[:index] if e.type == "step" and e.data["step"] == step]
        after = events[index + 1 : until]
        training = next((e for e in after if e.type == "status" and e.message.startswith("training ")), None)
        steps_after = [e for e in after if e.type == "step"]
        past = next((e for e in steps_after if e.data["step"] == step + 1), None)
        t_last = before[-1].time if before else None
        kill = kills[n] if n < len(kills) else None
        resumes_from = event.data["resumes_from"]
        # The checkpoint of the step the job was at, taken before the restart (engines lost only).
        rescued = any(
            e.type == "checkpoint" and e.data.get("step") == step and (kill is None or e.time > kill["time"])
            for e in events[:index]
        )

        def since(later: DriverEvent | None, earlier: float | None) -> float | None:
            return None if later is None or earlier is None else later.time - earlier

        first = steps_after[0] if steps_after else None
        out.append(
            {
                "killed": kill["part"] if kill else None,
                "lost": [item["name"] for item in event.data["lost"]],
                "step": step,
                "resumes_from": resumes_from,
                "rescue_checkpoint": rescued,
                "steps_redone": step - (resumes_from or 0),
                "into_step_s": None if kill is None or t_last is None else kill["time"] - t_last,
                "kill_to_recovery_s": None if kill is None else event.time - kill["time"],
                "start_s": since(training, event.time),
                "first_step_s": since(first, None if training is None else training.time),
                "fault_to_first_step_s": since(first, t_last),
                "fault_to_past_s": since(past, t_last),
            }
        )
    return out


def measure(job_file: Path, steps: int, arm: str, seed: int, every: int, save_steps: int) -> dict[str, Any]:
    """One run of `arm`: the job to its end (or failure), its kills and its events' times."""
    import ray

    from opd_trainer.cluster.ray_runtime import init_ray
    from opd_trainer.driver.job_driver import JobDriver
    from opd_trainer.storage.run_dir import RunDir

    # `JobDriver` itself under a name of its own: its process title is `ray::ChaosJobDriver`, which what
    # looks for `ray::JobDriver` processes on a shared machine (a test that kills its own job's driver by
    # that title) does not take for its own.
    chaos_driver = ray.remote(type("ChaosJobDriver", (JobDriver,), {}))
    plan = fault_plan(seed, steps, every) if arm == "chaos" else []
    spec = chaos_spec(job_file, steps, seed, save_steps, len(plan) if arm == "chaos" else None)
    run_dir = Path(tempfile.mkdtemp(prefix="opd-chaos-"))
    init_ray()
    started = time.perf_counter()
    driver = chaos_driver.options(num_cpus=0).remote(spec, str(run_dir))  # type: ignore[attr-defined]
    faults = Faults(driver, run_dir, plan)
    faults.start()
    error = None
    try:
        ray.get(driver.run.remote())
    except Exception as exc:  # a failed job is a result here
        error = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
    finally:
        faults.done.set()
        faults.join(timeout=10)
        ray.kill(driver)
    wall_s = time.perf_counter() - started
    log = RunDir(run_dir)
    events, records = log.events(), log.records()
    shutil.rmtree(run_dir, ignore_errors=True)
    evals = [r for r in records if r["kind"] == "eval"]
    train = [r for r in records if r["kind"] == "train"]
    intervals = step_intervals(events)
    # A fresh start's first step (the warm-up a recovery's first step also pays): its record after the
    # first 'training N steps' status.
    training = next((e for e in events if e.type == "status" and e.message.startswith("training ")), None)
    first = next((e for e in events if e.type == "step"), None)
    succeeded = error is None and any(e.type == "status" and e.message == "succeeded" for e in events)
    return {
        "arm": arm,
        "seed": seed,
        "steps": steps,
        "save_steps": save_steps,
        "plan": [{"after_step": after, "part": PARTS[part]} for after, part in plan],
        "kills": faults.killed,
        "succeeded": succeeded,
        "error": error,
        "wall_s": wall_s,
        "steps_recorded": len(train),
        "step_interval_s": statistics.median(intervals) if intervals else None,
        "step_s": statistics.median(r["time/step_s"] for r in train[1:]) if len(train) > 1 else None,
        "first_step_s": None if training is None or first is None else first.time - training.time,
        "recoveries": recoveries_of(events, faults.killed),
        "curve": [{"step": r["step"], "exact_match": r["exact_match"]} for r in evals],
        "final_exact_match": evals[-1]["exact_match"] if succeeded and evals else None,
    }


def _minus(value: float | None, step_s: float | None) -> float | None:
    return None if value is None or step_s is None else value - step_s


def losses(chaos: dict[str, Any], calm: dict[str, Any]) -> list[dict[str, Any]]:
    """The chaos run's recoveries with time lost, resume gap and ratio. One step is the chaos run's own
    median interval between step records with no fault between them (the machine's load at that run's
    time); `time_lost_ratio_vs_calm_run` takes the same seed's calm run's instead."""
    out = []
    for rec in chaos["recoveries"]:
        found: dict[str, Any] = {**rec, "seed": chaos["seed"]}
        for suffix, step_s in (("", chaos["step_interval_s"]), ("_vs_calm_run", calm["step_interval_s"])):
            lost = _minus(rec["fault_to_past_s"], step_s)
            found[f"time_lost_s{suffix}"] = lost
            found[f"resume_gap_s{suffix}"] = _minus(rec["fault_to_first_step_s"], step_s)
            ratio = None
            if lost is not None and rec["start_s"] is not None and step_s is not None:
                ratio = lost / (step_s + rec["start_s"])
            found[f"time_lost_ratio{suffix}"] = ratio
        out.append(found)
    return out


def _fmt(value: float | None, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--job", type=Path, default=EXAMPLE_JOB)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--every", type=int, default=10, help="one kill every this many steps (chaos arm)")
    parser.add_argument("--save-steps", type=int, default=20, help="the job's save_steps (the example's 20)")
    parser.add_argument(
        "--seeds", type=int, nargs="+", default=[0, 1, 2], help="one calm and one chaos run each"
    )
    parser.add_argument("--record", default="chaos", help="the record's name")
    parser.add_argument("--out", type=Path, default=None, help="default: benchmarks/results/RECORD.json")
    parser.add_argument(
        "--run-timeout-s", type=float, default=RUN_TIMEOUT_S, help="one run's process, at most"
    )
    add_publish_arguments(parser)
    parser.add_argument("--one-run", choices=list(ARMS), default=None, help=argparse.SUPPRESS)
    parser.add_argument("--one-run-out", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one_run is not None:
        result = measure(args.job, args.steps, args.one_run, args.seed, args.every, args.save_steps)
        write_one_run(args.one_run_out, result)
        return
    out = args.out or Path(f"benchmarks/results/{args.record}.json")
    shared = [
        "--job",
        str(args.job),
        "--steps",
        str(args.steps),
        "--every",
        str(args.every),
        "--save-steps",
        str(args.save_steps),
    ]
    pairs: list[tuple[dict[str, Any], dict[str, Any]]] = []
    for seed in args.seeds:
        calm, chaos = (
            run_child(SCRIPT, arm, [*shared, "--seed", str(seed)], timeout_s=args.run_timeout_s)
            for arm in ARMS
        )
        pairs.append((calm, chaos))
        print(f"[chaos] seed {seed}: calm {calm['succeeded']} chaos {chaos['succeeded']}", flush=True)
    runs = [run for pair in pairs for run in pair]
    recoveries = [rec for calm, chaos in pairs for rec in losses(chaos, calm)]
    calm_em = [calm["final_exact_match"] for calm, _ in pairs]
    chaos_em = [chaos["final_exact_match"] for _, chaos in pairs]
    diffs = [None if a is None or b is None else b - a for a, b in zip(calm_em, chaos_em, strict=True)]
    figures: dict[str, list[float | None]] = {
        "succeeded": [1.0 if chaos["succeeded"] else 0.0 for _, chaos in pairs],
        "time_lost_ratio": [r["time_lost_ratio"] for r in recoveries],
    }
    for short in PARTS.values():
        figures[f"time_lost_ratio/{short}"] = [
            r["time_lost_ratio"] for r in recoveries if r["killed"] == short
        ]
    figures |= {
        "time_lost_s": [r["time_lost_s"] for r in recoveries],
        "resume_gap_s": [r["resume_gap_s"] for r in recoveries],
        "component_start_s": [r["start_s"] for r in recoveries],
        "steps_redone": [float(r["steps_redone"]) for r in recoveries],
        "time_lost_ratio_vs_calm_run": [r["time_lost_ratio_vs_calm_run"] for r in recoveries],
        "step_s/calm": [calm["step_interval_s"] for calm, _ in pairs],
        "step_s/chaos": [chaos["step_interval_s"] for _, chaos in pairs],
        "first_step_s/start": [run["first_step_s"] for run in runs],
        "first_step_s/recovery": [r["first_step_s"] for r in recoveries],
        "final_exact_match/calm": calm_em,
        "final_exact_match/chaos": chaos_em,
        "final_exact_match_diff": diffs,
    }
    calm_present = [v for v in calm_em if v is not None]
    within = [
        v is not None and bool(calm_present) and min(calm_present) <= v <= max(calm_present) for v in chaos_em
    ]
    succeeded = sum(1 for _, chaos in pairs if chaos["succeeded"])
    kills = sum(len(chaos["kills"]) for _, chaos in pairs)
    notes = [
        f"one calm then one chaos run per seed ({', '.join(map(str, args.seeds))}), each a fresh process; "
        f"{args.steps} steps, save_steps {args.save_steps}, eval_steps the example job's; a kill every "
        f"{args.every} steps (SIGKILL; student engine, teacher engine or learner rank, seeded)",
        f"chaos jobs succeeded: {succeeded} of {len(pairs)}; kills {kills}, recoveries {len(recoveries)}",
        "time lost: from the last step record before the fault to the record of the step after it once the "
        "job is past it again, minus one step (the median interval between step records of the same chaos "
        "run with no fault between them; _vs_calm_run: of the same seed's calm run); ratio: time lost / "
        "(one step + component start, the recovery event to the 'training N steps' status after it)",
        f"chaos final exact match within the calm runs' range "
        f"({_fmt(min(calm_present, default=None), '.3f')}-{_fmt(max(calm_present, default=None), '.3f')}): "
        f"{sum(within)} of {len(within)}",
    ]
    print(f"{'arm':<6}{'seed':>5}{'ok':>4}{'kills':>6}{'step s':>8}{'wall s':>8}{'final EM':>10}")
    for run in runs:
        em = _fmt(run["final_exact_match"], ".3f")
        print(
            f"{run['arm']:<6}{run['seed']:>5}{'y' if run['succeeded'] else 'n':>4}{len(run['kills']):>6}"
            f"{_fmt(run['step_interval_s'], '.2f'):>8}{run['wall_s']:>8.0f}{em:>10}"
        )
    columns = [("seed", 4), ("killed", 9), ("step", 5), ("from", 5), ("into s", 8), ("to event s", 11)]
    columns += [("start s", 8), ("1st step s", 11), ("lost s", 8), ("gap s", 7), ("ratio", 7)]
    print("".join(f"{name:>{width}}" for name, width in columns))
    for r in recoveries:
        cells = [r["seed"], r["killed"], r["step"], r["resumes_from"], _fmt(r["into_step_s"])]
        cells += [_fmt(r["kill_to_recovery_s"]), _fmt(r["start_s"]), _fmt(r["first_step_s"])]
        cells += [_fmt(r["time_lost_s"]), _fmt(r["resume_gap_s"]), _fmt(r["time_lost_ratio"], ".2f")]
        print("".join(f"{cell!s:>{width}}" for cell, (_, width) in zip(cells, columns, strict=True)))
    for note in notes[1:]:
        print(note)
    write_json(out, {"runs": runs, "recoveries": recoveries, "notes": notes})
    record = new_record(
        args.record,
        {k: v for k, v in vars(args).items() if k not in {"one_run", "one_run_out", "seed"}},
        seeds=args.seeds,
        runs=runs,
        figures=figures,
        notes=notes,
    )
    write_record(record, publish=args.publish, results_dir=args.results_dir, published_dir=args.published_dir)


if __name__ == "__main__":
    main()
