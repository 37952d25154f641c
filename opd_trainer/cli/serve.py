"""`opd serve` and the job-server client commands: `submit`, `jobs`, `get`, `logs`, `cancel`, `keys create`.

Launch: `opd serve --data-dir ./opd-data` (API + embedded local Ray; `--ray-address` joins a cluster),
then `OPD_ADMIN_KEY=... opd keys create --tenant me`, `export OPD_API_KEY=...`,
`opd submit examples/model_opd_tiny/job.yaml --follow`. The client commands read `--base-url`/`--api-key`
or `OPD_BASE_URL`/`OPD_API_KEY`. Bad input prints one `error: field: message` line and exits 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from opd_trainer.errors import ConfigError, OPDError

USAGE_ERROR = 2


# -- opd serve ------------------------------------------------------------------------------------

# After SIGTERM/SIGINT, requests still open this long are cancelled (streams end by themselves sooner).
GRACEFUL_SHUTDOWN_S = 10


def _serve(args: argparse.Namespace) -> int:
    import uvicorn
    from pydantic import ValidationError

    from api.main import create_app
    from api.settings import Settings, withhold_secrets_from_children

    overrides: dict[str, Any] = {}
    if args.data_dir:
        overrides["data_dir"] = args.data_dir
    if args.ray_address:
        overrides["ray_address"] = args.ray_address
    if args.max_concurrent_jobs is not None:
        overrides["max_concurrent_jobs"] = args.max_concurrent_jobs
    try:
        settings = Settings(**overrides)
    except ValidationError as exc:
        first = exc.errors()[0]
        field = "OPD_" + ".".join(str(p) for p in first["loc"]).upper()
        print(f"error: {field}: {first['msg']}", file=sys.stderr)
        return USAGE_ERROR
    # Read once into `settings`; nothing started from here on (Ray, drivers, user code) inherits them.
    withhold_secrets_from_children()
    if settings.scheduler_enabled:
        from opd_trainer.driver.ray_runtime import init_ray

        # In the main thread: Ray installs signal handlers; the scheduler thread then finds it started.
        print(
            "starting Ray ..." if not settings.ray_address else f"joining Ray at {settings.ray_address} ..."
        )
        # reap_on_exit: an embedded Ray must not outlive this server, however it dies.
        init_ray(settings.ray_address, reap_on_exit=True)
    print(
        f"OPD job server on http://{args.host}:{args.port}  data dir {settings.data_dir}  "
        f"max concurrent jobs {settings.max_concurrent_jobs}",
        flush=True,
    )
    app = create_app(settings)

    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
    )
    # Open event streams end with a `shutdown` event on SIGTERM/SIGINT (sse-starlette watches uvicorn's
    # exit flag), so clients reconnect; uvicorn alone would wait for them before shutting down.
    uvicorn.Server(config).run()
    return 0


# -- client commands ------------------------------------------------------------------------------


def _client(args: argparse.Namespace) -> Any:
    from opd_trainer.client.api_client import OPDClient

    api_key = args.api_key or os.environ.get("OPD_API_KEY")
    if not api_key:
        raise ConfigError(
            "set OPD_API_KEY or pass --api-key (make one with `opd keys create`)", field="api_key"
        )
    return OPDClient(args.base_url, api_key)


def _submit(args: argparse.Namespace) -> int:
    from opd_trainer.spec.job_spec import load_job_spec

    spec = load_job_spec(Path(args.job_file))
    client = _client(args)
    job = client.submit(spec)
    print(f"submitted {job['id']} ({job['job_name']}): {job['status']}", flush=True)
    if not args.follow:
        return 0
    return _follow(client, job, Path(args.plot_dir) if args.plot_dir else Path("runs") / job["id"])


def _follow(client: Any, job: dict[str, Any], plot_dir: Path) -> int:
    """A progress bar fed by the job's event stream, then the final table and curves."""
    from tqdm import tqdm

    from opd_trainer.cli.train import format_final_table
    from opd_trainer.driver.plots import plot_curves

    bar = tqdm(total=job.get("total_steps") or None, unit="step", dynamic_ncols=True)
    final = job
    try:
        for event in client.stream_events(job["id"]):
            if event["type"] == "end":
                final = event["job"]
                break
            data = event.get("data") or {}
            if event["type"] == "step":
                if data.get("total_steps") and bar.total != data["total_steps"]:
                    bar.total = data["total_steps"]
                    bar.refresh()
                bar.update(max(0, int(data.get("step", bar.n)) - bar.n))
                postfix = {
                    k: f"{data[k]:.3f}" for k in ("reverse_kl", "loss") if isinstance(data.get(k), float)
                }
                bar.set_postfix(postfix)
            elif event["type"] != "autoscale":
                bar.write(f"[{event['type']}] {event['message']}")
    finally:
        bar.close()
    print(f"job {final['id']}: {final['status']}")
    if final["status"] != "succeeded":
        if final.get("error"):
            error = final["error"]
            print(f"error: {error['param'] + ': ' if error.get('param') else ''}{error['message']}")
        return 1
    metrics = client.metrics(final["id"])
    if metrics["data"]:
        print(f"curves: {plot_curves(metrics['data'], plot_dir / 'curves.png', final['job_name'])}")
    if metrics["summary"]:
        print(format_final_table(metrics["summary"]))
    return 0


def _jobs(args: argparse.Namespace) -> int:
    page = _client(args).list_jobs(status=args.status, limit=args.limit)
    print(f"{'id':<32} {'status':<12} {'step':>9}  {'created':<20} name")
    for job in page["data"]:
        steps = f"{job['step']}/{job['total_steps'] if job['total_steps'] is not None else '?'}"
        created = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(job["created_at"]))
        print(f"{job['id']:<32} {job['status']:<12} {steps:>9}  {created:<20} {job['job_name']}")
    if page["has_more"]:
        print(f"... more: --limit {args.limit * 2}")
    return 0


def _get(args: argparse.Namespace) -> int:
    print(json.dumps(_client(args).get_job(args.job_id), indent=2))
    return 0


def _logs(args: argparse.Namespace) -> int:
    client = _client(args)
    if not args.follow:
        sys.stdout.write(client.logs(args.job_id))
        return 0
    for event in client.stream_events(args.job_id):
        if event["type"] == "end":
            print(f"-- job {event['job']['status']}")
            break
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(event["time"]))
        print(f"{stamp}Z [{event['type']}] {event['message']}", flush=True)
    return 0


def _cancel(args: argparse.Namespace) -> int:
    job = _client(args).cancel_job(args.job_id)
    print(f"{job['id']}: {job['status']}")
    return 0


def _keys_create(args: argparse.Namespace) -> int:
    from opd_trainer.client.api_client import OPDClient

    admin_key = args.admin_key or os.environ.get("OPD_ADMIN_KEY")
    if not admin_key:
        raise ConfigError("set OPD_ADMIN_KEY or pass --admin-key", field="admin_key")
    with OPDClient(args.base_url, api_key="") as client:
        key = client.create_key(args.tenant, admin_key)
    print(f"tenant {key['tenant']}: key {key['id']}")
    print(key["key"])
    return 0


# -- error handling and registration --------------------------------------------------------------


def _guarded(handler: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """Bad input → one `error: field: message` line and exit 2; a server fault or no server → exit 1."""

    def run(args: argparse.Namespace) -> int:
        import httpx

        from opd_trainer.client.api_client import OPDAPIError

        try:
            return handler(args)
        except OPDAPIError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return USAGE_ERROR if 400 <= exc.status < 500 else 1
        except OPDError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return USAGE_ERROR
        except httpx.HTTPError as exc:
            base = getattr(args, "base_url", None) or os.environ.get("OPD_BASE_URL", "the job server")
            print(f"error: cannot reach {base}: {exc}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            return 130

    return run


def _connection_options() -> argparse.ArgumentParser:
    parent = argparse.ArgumentParser(add_help=False)
    parent.add_argument("--base-url", help="job server URL (default $OPD_BASE_URL or http://127.0.0.1:8000)")
    parent.add_argument("--api-key", help="tenant key (default $OPD_API_KEY)")
    return parent


def add_server_commands(commands: Any) -> None:
    """Registers `serve` and the client commands on `opd`'s subparsers."""
    connection = _connection_options()

    serve = commands.add_parser("serve", help="run the job server (API + embedded Ray + data dir)")
    serve.add_argument("--host", default="127.0.0.1", help="interface to listen on")
    serve.add_argument("--port", type=int, default=8000, help="port to listen on")
    serve.add_argument(
        "--data-dir", help="files, workspaces, runs and SQLite (default $OPD_DATA_DIR or ./opd-data)"
    )
    serve.add_argument("--ray-address", help="join this Ray cluster instead of starting a local Ray")
    serve.add_argument("--max-concurrent-jobs", type=int, help="jobs running at once (0: queue only, no Ray)")
    serve.add_argument("--log-level", default="info", help="uvicorn log level")
    serve.set_defaults(handler=_serve)

    submit = commands.add_parser("submit", parents=[connection], help="upload a job's files and submit it")
    submit.add_argument("job_file", help="job spec, YAML or JSON (local paths are uploaded)")
    submit.add_argument("--follow", action="store_true", help="show progress until the job finishes")
    submit.add_argument("--plot-dir", help="where --follow writes curves.png (default runs/JOB_ID)")
    submit.set_defaults(handler=_guarded(_submit))

    jobs = commands.add_parser("jobs", parents=[connection], help="list your jobs, newest first")
    jobs.add_argument("--status", help="only jobs in this status")
    jobs.add_argument("--limit", type=int, default=20, help="how many")
    jobs.set_defaults(handler=_guarded(_jobs))

    get = commands.add_parser("get", parents=[connection], help="show one job as JSON")
    get.add_argument("job_id")
    get.set_defaults(handler=_guarded(_get))

    logs = commands.add_parser("logs", parents=[connection], help="a job's event log")
    logs.add_argument("job_id")
    logs.add_argument("-f", "--follow", action="store_true", help="stream until the job finishes")
    logs.set_defaults(handler=_guarded(_logs))

    cancel = commands.add_parser("cancel", parents=[connection], help="cancel a job")
    cancel.add_argument("job_id")
    cancel.set_defaults(handler=_guarded(_cancel))

    keys = commands.add_parser("keys", help="API keys")
    key_commands = keys.add_subparsers(dest="keys_command", required=True)
    create = key_commands.add_parser("create", parents=[connection], help="create a tenant key (admin key)")
    create.add_argument("--tenant", required=True, help="tenant name (created on first use)")
    create.add_argument("--admin-key", help="the server's admin key (default $OPD_ADMIN_KEY)")
    create.set_defaults(handler=_guarded(_keys_create))
