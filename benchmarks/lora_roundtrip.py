"""An end-to-end LoRA job through `opd serve`; its downloaded merged model checked in transformers.

One run: a fresh `opd serve` (loopback, free port, data dir under a temp folder, an admin key, a
tenant key; `OPD_MODEL_DIRS` approves the models folder) takes a 3-step LoRA job (r 16, alpha 32;
4 prompts x 2 rollouts, <= 48 tokens, validation greedy before training and after the last step),
followed to its end (bounded). Then its `fine_tuned_model` is downloaded twice through `OPDClient`:
as the adapter folder (which must hold `adapter_config.json` + `adapter_model.safetensors`) and with
`merged=True`. The merged folder is loaded with `transformers.AutoModelForCausalLM`, and each recorded
validation rollout of the checkpoint's pass (`GET /v1/opd/jobs/{id}/validation_trajectories`, the pass
at the checkpoint's step: `student after`) is generated again, greedily, from the same prompt token ids
(`chat.py` `prompt_token_ids` on the sample's messages and tools, as the job rendered it) with
the same max tokens. An answer is reproduced when its tokens' texts equal the recorded ones token for
token; for one that is not, the first differing position and, under transformers at that position, the
logprob of its own greedy token minus that of the token vLLM chose (`logprob_gap`: a near-tie explains a
divergence between vLLM's and transformers' numerics, a large gap does not).

Models: `--models-dir` with `student/` and `teacher/` (default `.cache/scale-models/500m`, the random
Qwen2.5-0.5B-shaped pair `benchmarks/scale.py` builds; prompts: 64 short arithmetic chat prompts, 16 of
them validation). `--tiny`: the tiny models (`$OPD_TINY_MODELS_DIR` or `.cache/tiny-models`) with their
`data/train.jsonl` and the first 16 lines of `data/validation.jsonl`.

    .venv/bin/python benchmarks/lora_roundtrip.py --tiny                  # smoke, record lora_roundtrip_tiny
    .venv/bin/python benchmarks/lora_roundtrip.py                         # 500M pair, record lora_roundtrip
    .venv/bin/python benchmarks/lora_roundtrip.py --repeats 3 --publish   # publishable figure

Record (`benchmarks/records.py`): per run the wall time, job status and error, steps, the adapter's and
the merged folder's bytes, whether the merged model loaded, the reproduced fraction (token for token,
and of the decoded texts) and every divergence; figures `reproduced_fraction` (headline) and `wall_s`.
A benchmark, not CI: the 500M pair takes ~10+ minutes a run on 2 cores.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
from records import add_publish_arguments, new_record, write_record

ROOT = Path(__file__).resolve().parent.parent
TINY_MODELS_DIR = Path(os.environ.get("OPD_TINY_MODELS_DIR", ROOT / ".cache" / "tiny-models"))
SCALE_MODELS_DIR = ROOT / ".cache" / "scale-models" / "500m"
LORA = {"r": 16, "lora_alpha": 32}
VALIDATION_SAMPLES = 16  # the server records the first 16 rollouts of each validation pass
FINISHED = ("succeeded", "failed", "cancelled")


# -- data ------------------------------------------------------------------------------------------


def arithmetic_records(count: int, offset: int) -> list[dict[str, Any]]:
    """Short chat prompts (OPD needs no reference answers), each with its own `sample_id`."""
    records = []
    for i in range(offset, offset + count):
        a, b = 3 + (i * 7) % 41, 2 + (i * 13) % 29
        op = "+-*"[i % 3]
        prompt = f"What is {a} {op} {b}?"
        records.append(
            {"messages": [{"role": "user", "content": prompt}], "rollout_extra": {"sample_id": f"arith-{i}"}}
        )
    return records


def write_jsonl(path: Path, records: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    return path


def datasets(args: argparse.Namespace, folder: Path) -> tuple[Path, Path]:
    """The training and validation files of the run (the validation one has `VALIDATION_SAMPLES`)."""
    data = args.models_dir / "data"
    if args.tiny:
        validation = [json.loads(line) for line in (data / "validation.jsonl").read_text().splitlines()]
        return data / "train.jsonl", write_jsonl(folder / "validation.jsonl", validation[:VALIDATION_SAMPLES])
    train = write_jsonl(folder / "train.jsonl", arithmetic_records(64, 0))
    return train, write_jsonl(folder / "validation.jsonl", arithmetic_records(VALIDATION_SAMPLES, 1000))


def job_spec(args: argparse.Namespace, train: Path, validation: Path, seed: int) -> dict[str, Any]:
    engine: dict[str, Any] = {"kv_cache_memory_bytes": args.kv_cache_mib * 1024**2}
    if args.engine_dtype:
        engine["dtype"] = args.engine_dtype
    return {
        "job_name": f"lora-roundtrip-s{seed}",
        "model": str((args.models_dir / "student").resolve()),
        "teacher_model": str((args.models_dir / "teacher").resolve()),
        "training_datasets": [str(train)],
        "validation_datasets": [str(validation)],
        "hyper_parameters": {
            "max_steps": args.steps,
            "learning_rate": args.learning_rate,
            "lr_scheduler_type": "constant",
            "batch_size": 4,
            "n_rollouts": 2,
            "ppo_mini_batch_size": 8,
            "max_length": args.max_length,
            "max_tokens": args.max_tokens,
            # Validation runs before training and after the last step (`student after`); eval_steps =
            # steps adds no pass in between. Validation is greedy (eval_temperature is pass@k's only).
            "eval_steps": args.steps,
            "save_steps": 10**6,  # one checkpoint: the last step's
            "seed": seed,
            "lora": LORA,
        },
        "resources": {"student": engine, "teacher": dict(engine), "learner_gpus": 0, "zero_stage": 2},
        "report_to": [],
    }


# -- the server ------------------------------------------------------------------------------------


def _descendants(pid: int) -> list[int]:
    try:
        import psutil

        return [p.pid for p in psutil.Process(pid).children(recursive=True)]
    except Exception:
        return []


@contextlib.contextmanager
def job_server(data_dir: Path, models_dir: Path, admin_key: str, ready_s: float) -> Iterator[str]:
    """`opd serve` on a free loopback port; stopped (SIGTERM, then SIGKILL of what it started) on exit."""
    from opd_trainer.cluster.ports import free_port

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {
        **os.environ,
        "OPD_ADMIN_KEY": admin_key,
        "OPD_MODEL_DIRS": json.dumps([str(models_dir.resolve())]),
        "PYTHONUNBUFFERED": "1",
    }
    log_path = data_dir.parent / "server.log"
    command = [sys.executable, "-m", "opd_trainer.cli", "serve", "--host", "127.0.0.1", "--port", str(port)]
    command += ["--data-dir", str(data_dir), "--log-level", "warning"]
    with log_path.open("ab") as log:
        process = subprocess.Popen(
            command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    started: set[int] = set()
    try:
        deadline = time.monotonic() + ready_s
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"opd serve exited with {process.returncode}; see {log_path}")
            with contextlib.suppress(httpx.HTTPError, ValueError):
                response = httpx.get(url + "/readyz", timeout=2)
                if response.status_code == 200 and response.json().get("status") == "ok":
                    break
            if time.monotonic() > deadline:
                raise TimeoutError(f"opd serve not ready after {ready_s:.0f}s; see {log_path}")
            time.sleep(1)
        print(f"server ready on {url} (log {log_path})", flush=True)
        yield url
    finally:
        started.update(_descendants(process.pid))
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=30)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)  # the server's own group, whatever is left of it
        time.sleep(2)
        for pid in started:  # Ray's processes may have left the group; these are the server's children
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)


# -- one run ---------------------------------------------------------------------------------------


def _token_texts(record: dict[str, Any]) -> list[list[str]] | None:
    calls = record.get("llm_calls") or []
    if not all(c.get("tokens") for c in calls):
        return None
    return [list(c["tokens"]["text"]) for c in calls]


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def last_pass(client: Any, job_id: str, step: int) -> tuple[str | None, list[dict[str, Any]]]:
    """The label and records of the last student validation pass at `step` (the checkpoint's)."""
    listing = client.validation_trajectories(job_id, step=step, model="student", limit=1)
    labels = [p.label for p in listing.passes if p.step == step and p.model == "student"]
    if not labels:
        return None, []
    label = labels[-1]
    page = client.validation_trajectories(
        job_id, step=step, label=label, model="student", limit=VALIDATION_SAMPLES
    )
    return label, page.data


def compare(merged: Path, records: list[dict[str, Any]], samples: dict[str, Any], args: argparse.Namespace):
    """Greedy generation of each recorded validation rollout with transformers; per rollout whether it
    is reproduced, and where it is not the first differing position and the logprob gap there."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from opd_trainer.chat import prompt_token_ids

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    started = time.perf_counter()
    dtype = getattr(torch, args.hf_dtype) if args.hf_dtype != "auto" else "auto"
    model = AutoModelForCausalLM.from_pretrained(str(merged), dtype=dtype)
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(str(merged))
    load_s = time.perf_counter() - started
    eos = model.generation_config.eos_token_id
    eos_ids = sorted({*(eos if isinstance(eos, list) else [eos] if eos is not None else [])})
    if tokenizer.eos_token_id is not None and not eos_ids:
        eos_ids = [tokenizer.eos_token_id]
    texts_of: dict[str, list[int]] = {}
    for token_id in range(len(tokenizer)):
        texts_of.setdefault(tokenizer.decode([token_id]), []).append(token_id)

    rows = []
    for record in records:
        sample = samples.get(record["sample_id"])
        calls = record.get("llm_calls") or []
        row: dict[str, Any] = {"sample_id": record["sample_id"]}
        if sample is None or len(calls) != 1 or not calls[0].get("tokens"):
            row["skipped"] = "no local sample" if sample is None else "not one scored LLM call"
            rows.append(row)
            continue
        call = calls[0]
        recorded = list(call["tokens"]["text"])
        prompt = prompt_token_ids(tokenizer, sample["messages"], sample.get("tools"))
        row["prompt_tokens"] = len(prompt)
        row["prompt_tokens_recorded"] = call["prompt_tokens"]
        with torch.no_grad():
            out = model.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=args.max_tokens,
                do_sample=False,
                eos_token_id=eos_ids or None,
                pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_ids[0],
                output_logits=True,
                return_dict_in_generate=True,
            )
        generated = out.sequences[0, len(prompt) :].tolist()
        mine = [tokenizer.decode([t]) for t in generated]
        row["tokens"] = len(generated)
        row["tokens_recorded"] = len(recorded)
        row["reproduced"] = mine == recorded
        row["text_reproduced"] = "".join(mine) == "".join(recorded)
        if not row["reproduced"]:
            position = next((i for i, (a, b) in enumerate(zip(mine, recorded, strict=False)) if a != b), None)
            if position is None:
                position = min(len(mine), len(recorded))
            row["position"] = position
            row["hf_token"] = mine[position] if position < len(mine) else None
            row["recorded_token"] = recorded[position] if position < len(recorded) else None
            if position < len(out.logits):
                logprobs = torch.log_softmax(out.logits[position][0].float(), dim=-1)
                hf_id = generated[position] if position < len(generated) else None
                # vLLM stopped here (no recorded token): it ended on one of the eos ids.
                token = row["recorded_token"]
                candidates = eos_ids if token is None else texts_of.get(token, [])
                if hf_id is not None and candidates:
                    best = max(candidates, key=lambda t: float(logprobs[t]))
                    row["recorded_token_ids"] = candidates
                    row["hf_logprob"] = float(logprobs[hf_id])
                    row["recorded_logprob"] = float(logprobs[best])
                    row["logprob_gap"] = row["hf_logprob"] - row["recorded_logprob"]
                    row["near_tie"] = row["logprob_gap"] <= args.tie_nats
        rows.append(row)
    info = {"load_s": load_s, "dtype": str(next(model.parameters()).dtype), "eos_ids": eos_ids}
    del model
    return rows, info


def run_once(args: argparse.Namespace, client: Any, work: Path, seed: int) -> dict[str, Any]:
    folder = work / f"run-s{seed}"
    folder.mkdir(parents=True)
    train, validation = datasets(args, folder)
    samples = {}
    for line in validation.read_text().splitlines():
        sample = json.loads(line)
        samples[str(sample["rollout_extra"]["sample_id"])] = sample
    run: dict[str, Any] = {"seed": seed, "models_dir": str(args.models_dir), "tiny": args.tiny}
    started = time.monotonic()
    job = client.submit(job_spec(args, train, validation, seed))
    run["job_id"] = job.id
    print(f"submitted {job.id}", flush=True)
    try:
        job = client.wait(job.id, poll_s=5, timeout_s=args.job_timeout_s)
    except TimeoutError:
        with contextlib.suppress(Exception):
            client.cancel_job(job.id)
        job = client.get_job(job.id)
        run["timed_out"] = True
    run["wall_s"] = time.monotonic() - started
    run["status"] = job.status
    run["steps"] = job.step
    run["total_steps"] = job.total_steps
    run["error"] = job.error.model_dump() if job.error else None
    run["fine_tuned_model"] = job.fine_tuned_model
    print(f"job {job.id}: {job.status} after {run['wall_s']:.0f}s, step {job.step}", flush=True)
    if job.status != "succeeded" or job.fine_tuned_model is None:
        with contextlib.suppress(Exception):
            run["log_tail"] = client.logs(job.id)[-4000:]
        return run

    checkpoint = next(c for c in client.checkpoints(job.id) if c.id == job.fine_tuned_model)
    run["checkpoint_step"] = checkpoint.step
    adapter = client.download_checkpoint(job.id, target=folder / "adapter")
    merged = client.download_checkpoint(job.id, target=folder / "merged", merged=True)
    run["adapter_files"] = sorted(p.name for p in adapter.iterdir())
    run["adapter_ok"] = all(
        (adapter / n).is_file() for n in ("adapter_config.json", "adapter_model.safetensors")
    )
    run["adapter_bytes"] = folder_bytes(adapter)
    run["merged_bytes"] = folder_bytes(merged)
    run["merged_has_adapter_files"] = (merged / "adapter_config.json").exists()
    label, records = last_pass(client, job.id, checkpoint.step)
    run["validation_label"] = label
    run["validation_records"] = len(records)
    # Whether the adapter changed anything: the answers that differ from the starting student's.
    _, before = last_pass(client, job.id, 0)
    before_tokens = {r["sample_id"]: _token_texts(r) for r in before}
    run["changed_by_training"] = sum(
        r["sample_id"] in before_tokens and _token_texts(r) != before_tokens[r["sample_id"]] for r in records
    )
    try:
        rows, info = compare(merged, records, samples, args)
    except Exception as exc:  # a merged model that does not load is the result, not a crash
        run["load_ok"] = False
        run["load_error"] = f"{type(exc).__name__}: {exc}"[:2000]
        return run
    run["load_ok"] = True
    run |= {f"hf_{k}": v for k, v in info.items()}
    compared = [r for r in rows if "reproduced" in r]
    run["compared"] = len(compared)
    run["skipped"] = [r for r in rows if "skipped" in r]
    run["prompt_length_mismatches"] = sum(r["prompt_tokens"] != r["prompt_tokens_recorded"] for r in compared)
    run["reproduced"] = sum(r["reproduced"] for r in compared)
    run["reproduced_fraction"] = run["reproduced"] / len(compared) if compared else None
    run["text_reproduced_fraction"] = (
        sum(r["text_reproduced"] for r in compared) / len(compared) if compared else None
    )
    run["divergences"] = [r for r in compared if not r["reproduced"]]
    gaps = [r["logprob_gap"] for r in run["divergences"] if "logprob_gap" in r]
    run["max_divergence_gap"] = max(gaps) if gaps else None
    if not args.keep:
        shutil.rmtree(merged, ignore_errors=True)
    return run


def summary_line(run: dict[str, Any]) -> str:
    if run.get("reproduced_fraction") is None:
        return f"status {run['status']}, steps {run['steps']}, load_ok {run.get('load_ok')}: no comparison"
    gaps = ", ".join(
        f"{d['sample_id']}@{d['position']} gap {d.get('logprob_gap', math.nan):.3g}"
        for d in run["divergences"]
    )
    return (
        f"status {run['status']}, steps {run['steps']}, {run['wall_s']:.0f}s; adapter "
        f"{run['adapter_bytes'] / 2**20:.1f} MiB, merged {run['merged_bytes'] / 2**20:.1f} MiB; reproduced "
        f"{run['reproduced']}/{run['compared']} ({run['reproduced_fraction']:.0%}), text "
        f"{run['text_reproduced_fraction']:.0%}; {run['changed_by_training']} differ from the starting "
        "student's" + (f"; divergences: {gaps}" if gaps else "")
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models-dir", type=Path, default=None, help="student/ and teacher/ (default 500M)")
    parser.add_argument("--tiny", action="store_true", help="the tiny models and their data (smoke)")
    parser.add_argument("--repeats", type=int, default=1, help="runs, one after another (3: publishable)")
    parser.add_argument("--seed", type=int, default=0, help="run i's job seed is seed + i")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--max-length", type=int, default=None, help="default 1024 tiny, 128 otherwise")
    parser.add_argument(
        "--learning-rate", type=float, default=2e-3, help="LoRA's (the tiny pair learns at it)"
    )
    parser.add_argument("--kv-cache-mib", type=int, default=256, help="each engine's KV cache")
    parser.add_argument(
        "--engine-dtype", default=None, help="engines' dtype (default: tiny float32, else auto)"
    )
    parser.add_argument("--hf-dtype", default="auto", help="transformers' dtype for the merged model")
    parser.add_argument(
        "--tie-nats", type=float, default=0.1, help="a divergence gap at most this is a near-tie"
    )
    parser.add_argument("--job-timeout-s", type=float, default=1800)
    parser.add_argument("--ready-timeout-s", type=float, default=300)
    parser.add_argument("--name", default=None, help="record name (default lora_roundtrip, tiny: _tiny)")
    parser.add_argument("--keep", action="store_true", help="keep the temp folder (server data, downloads)")
    add_publish_arguments(parser)
    args = parser.parse_args()
    if args.models_dir is None:
        args.models_dir = TINY_MODELS_DIR if args.tiny else SCALE_MODELS_DIR
    args.models_dir = args.models_dir.resolve()
    if args.max_length is None:
        args.max_length = 1024 if args.tiny else 128
    if args.engine_dtype is None and args.tiny:
        args.engine_dtype = "float32"
    name = args.name or ("lora_roundtrip_tiny" if args.tiny else "lora_roundtrip")
    for role in ("student", "teacher"):
        if not (args.models_dir / role / "config.json").is_file():
            sys.exit(f"{args.models_dir / role} is not a model folder")

    from opd_trainer.client.api_client import OPDClient

    work = Path(tempfile.mkdtemp(prefix="lora-roundtrip-"))
    print(f"work folder {work}", flush=True)
    admin_key = secrets.token_urlsafe(32)
    runs: list[dict[str, Any]] = []
    notes: list[str] = []
    try:
        with job_server(work / "data", args.models_dir, admin_key, args.ready_timeout_s) as url:
            tenant_key = OPDClient(url, api_key=admin_key).create_key("bench", admin_key).key
            with OPDClient(url, api_key=tenant_key) as client:
                for repeat in range(args.repeats):
                    try:
                        run = run_once(args, client, work, args.seed + repeat)
                    except Exception as exc:
                        run = {"seed": args.seed + repeat, "status": "error", "steps": None}
                        run["error"] = f"{type(exc).__name__}: {exc}"[:2000]
                    run["repeat"] = repeat
                    runs.append(run)
                    print(f"run {repeat}: {summary_line(run)}", flush=True)
    except Exception as exc:
        notes.append(f"server: {type(exc).__name__}: {exc}"[:2000])
        print(notes[-1], flush=True)
    finally:
        log = work / "server.log"
        if log.exists():
            tail = log.read_text(errors="replace")[-3000:]
            if any(r.get("status") != "succeeded" for r in runs) or not runs:
                notes.append(f"server log tail: {tail}")
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)

    notes.append(
        "reproduced: the merged model's greedy tokens (transformers) equal the recorded validation "
        "tokens (vLLM serving base + adapter) token for token; logprob_gap: at the first differing "
        "position, transformers' logprob of its own token minus that of vLLM's token."
    )
    record = new_record(
        name,
        args,
        seeds=[args.seed + r for r in range(args.repeats)],
        runs=runs,
        figures={
            "reproduced_fraction": [r.get("reproduced_fraction") for r in runs],
            "text_reproduced_fraction": [r.get("text_reproduced_fraction") for r in runs],
            "wall_s": [r.get("wall_s") if r.get("status") == "succeeded" else None for r in runs],
        },
        headline=("reproduced_fraction",),
        models_dir=args.models_dir,
        notes=notes,
    )
    write_record(record, publish=args.publish, results_dir=args.results_dir, published_dir=args.published_dir)
    ok = runs and all(r.get("status") == "succeeded" and r.get("load_ok") for r in runs)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
