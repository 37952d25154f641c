"""Job server under load: 200 concurrent status pollers, 20 concurrent submissions; table + JSON.

Starts its own `opd serve` (SQLite file in a temporary data dir, `OPD_MAX_CONCURRENT_JOBS=0` so jobs
stay queued and no Ray starts), creates a tenant, uploads one dataset, then measures:

- submit: 20 job submissions at once (each runs the full pre-flight, incl. the tokenizer check);
- poll: 200 clients each polling one job's status every `--interval` seconds for `--duration`
  seconds, start times spread over one interval (the way dashboards and `opd get` loops poll);
- burst: 200 status reads fired at the same instant (informational: pure queueing on 2 cores).

Target: poll p99 < 200 ms and zero 5xx anywhere. The load generator shares the machine's cores with
the server, so the numbers are an upper bound of the server's own latency.
Launch: `.venv/bin/python benchmarks/api_load.py` (CPU only; uses the tiny models' tokenizer if
`--models-dir` holds them, else writes a throwaway tokenizer).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from opd_trainer.ports import free_port

REPO = Path(__file__).resolve().parents[1]
ADMIN_KEY = "bench-admin-key-0123456789"
READ_P99_TARGET_S = 0.2


def _tokenizer_dir(models_dir: Path, scratch: Path) -> str:
    if (models_dir / "student" / "tokenizer.json").is_file():
        return str((models_dir / "student").resolve())
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]")
    fast.save_pretrained(str(scratch / "tokenizer"))
    return str(scratch / "tokenizer")


def _start_server(data_dir: Path, port: int, model: str) -> subprocess.Popen[bytes]:
    env = {**os.environ, "OPD_ADMIN_KEY": ADMIN_KEY, "OPD_MAX_CONCURRENT_JOBS": "0"}
    env["OPD_MODEL_DIRS"] = json.dumps([str(Path(model).resolve().parent)])
    env["OPD_TENANT_MAX_ACTIVE_JOBS"] = "1000"
    command = [sys.executable, "-m", "opd_trainer.cli", "serve", "--port", str(port)]
    command += ["--data-dir", str(data_dir), "--log-level", "warning"]
    process = subprocess.Popen(command, cwd=REPO, env=env, start_new_session=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=1).status_code == 200:
                return process
        except httpx.HTTPError:
            time.sleep(0.2)
    process.kill()
    raise TimeoutError("server did not start")


def _summary(name: str, latencies: list[float], statuses: list[int]) -> dict[str, Any]:
    ordered = sorted(latencies)
    p99_index = min(len(ordered) - 1, max(0, round(0.99 * len(ordered)) - 1))
    return {
        "operation": name,
        "requests": len(statuses),
        "p50_ms": 1000 * statistics.median(ordered),
        "p99_ms": 1000 * ordered[p99_index],
        "max_ms": 1000 * ordered[-1],
        "errors": sum(1 for s in statuses if s >= 400 or s == 0),
        "server_errors_5xx": sum(1 for s in statuses if s >= 500),
    }


async def _timed(client: httpx.AsyncClient, method: str, url: str, **kwargs: Any) -> tuple[float, int]:
    started = time.perf_counter()
    try:
        response = await client.request(method, url, **kwargs)
        status = response.status_code
    except httpx.HTTPError:
        status = 0  # counted as an error: the server dropped or refused the connection
    return time.perf_counter() - started, status


async def _measure(
    base_url: str, model: str, pollers: int, submissions: int, interval: float, duration: float
) -> list[dict[str, Any]]:
    limits = httpx.Limits(
        max_connections=pollers + submissions, max_keepalive_connections=pollers + submissions
    )
    async with httpx.AsyncClient(base_url=base_url, timeout=60, limits=limits) as admin:
        key = (
            await admin.post(
                "/v1/keys", json={"tenant": "bench"}, headers={"Authorization": f"Bearer {ADMIN_KEY}"}
            )
        ).json()["key"]
    headers = {"Authorization": f"Bearer {key}"}
    async with httpx.AsyncClient(base_url=base_url, timeout=60, headers=headers, limits=limits) as client:
        record = {"messages": [{"role": "user", "content": "hello"}]}
        dataset = (
            await client.post(
                "/v1/files",
                files={"file": ("d.jsonl", json.dumps(record).encode())},
                data={"purpose": "dataset"},
            )
        ).json()
        spec = {
            "job_name": "bench",
            "model": model,
            "teacher_model": model,
            "training_datasets": [dataset["id"]],
            "hyper_parameters": {"max_steps": 1},
        }
        await client.post("/v1/opd/jobs", json=spec)  # warm the tokenizer import before timing

        submitted = await asyncio.gather(
            *(_timed(client, "POST", "/v1/opd/jobs", json=spec) for _ in range(submissions))
        )
        jobs = (await client.get("/v1/opd/jobs", params={"limit": 100})).json()["data"]
        job_ids = [j["id"] for j in jobs]

        latencies: list[float] = []
        statuses: list[int] = []

        async def poller(job_id: str) -> None:
            await asyncio.sleep(random.uniform(0, interval))
            deadline = time.perf_counter() + duration
            while time.perf_counter() < deadline:
                started = time.perf_counter()
                latency, status = await _timed(client, "GET", f"/v1/opd/jobs/{job_id}")
                latencies.append(latency)
                statuses.append(status)
                await asyncio.sleep(max(0.0, interval - (time.perf_counter() - started)))

        await asyncio.gather(*(poller(random.choice(job_ids)) for _ in range(pollers)))
        burst = await asyncio.gather(
            *(_timed(client, "GET", f"/v1/opd/jobs/{random.choice(job_ids)}") for _ in range(pollers))
        )
    return [
        _summary(f"submit ({submissions} at once)", [s[0] for s in submitted], [s[1] for s in submitted]),
        _summary(f"poll ({pollers} clients, every {interval:g}s)", latencies, statuses),
        _summary(f"burst ({pollers} reads at once)", [b[0] for b in burst], [b[1] for b in burst]),
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models-dir", default=".cache/tiny-models", help="tiny models (for the tokenizer)")
    parser.add_argument("--pollers", type=int, default=200, help="concurrent status pollers")
    parser.add_argument("--submissions", type=int, default=20, help="concurrent job submissions")
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between one poller's polls")
    parser.add_argument("--duration", type=float, default=10.0, help="seconds each poller polls")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/api_load.json"), help="JSON")
    args = parser.parse_args()
    random.seed(0)
    with tempfile.TemporaryDirectory() as scratch:
        model = _tokenizer_dir(Path(args.models_dir), Path(scratch))
        port = free_port()
        server = _start_server(Path(scratch) / "data", port, model)
        try:
            rows = asyncio.run(
                _measure(
                    f"http://127.0.0.1:{port}",
                    model,
                    args.pollers,
                    args.submissions,
                    args.interval,
                    args.duration,
                )
            )
        finally:
            os.killpg(server.pid, signal.SIGTERM)
            server.wait(timeout=30)
    print(f"{'operation':<32}{'requests':>9}{'p50 ms':>9}{'p99 ms':>9}{'max ms':>9}{'errors':>8}{'5xx':>6}")
    for row in rows:
        print(
            f"{row['operation']:<32}{row['requests']:>9}{row['p50_ms']:>9.1f}{row['p99_ms']:>9.1f}{row['max_ms']:>9.1f}{row['errors']:>8}{row['server_errors_5xx']:>6}"
        )
    poll = rows[1]
    ok = poll["p99_ms"] < 1000 * READ_P99_TARGET_S and all(r["server_errors_5xx"] == 0 for r in rows)
    verdict = "meets" if ok else "MISSES"
    print(f"{verdict} the target: poll p99 < {1000 * READ_P99_TARGET_S:.0f} ms and no 5xx")
    result = {
        "rows": rows,
        "target": {"poll_p99_ms": 1000 * READ_P99_TARGET_S, "server_errors_5xx": 0},
        "meets_target": ok,
        "cpu_count": os.cpu_count(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
