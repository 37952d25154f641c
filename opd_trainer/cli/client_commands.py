"""The job-server client commands: jobs (`submit`, `jobs`, `get`, `logs`, `cancel`, `pause`, `resume`,
`delete`, `checkpoints`, `download`, `metrics`, `usage`), `files`, `keys` and `webhooks`.

They read `--base-url`/`--api-key` or `OPD_BASE_URL`/`OPD_API_KEY` (`--admin-key`/`OPD_ADMIN_KEY` for
key management). `-o json` prints the server's object instead of the text line or table. Bad input
prints one `error: field: message` line on stderr and exits 2; a server fault or no server exits 1;
Ctrl-C while following a job says that the job goes on and exits 130.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from opd_trainer.driver.plots import format_final_table, plot_curves
from opd_trainer.errors import ConfigError, OPDError
from opd_trainer.jobspec.job_status import format_event_line

if TYPE_CHECKING:
    from opd_trainer.client.api_client import OPDClient
    from opd_trainer.wire.schemas import EventPublic, JobPublic

USAGE_ERROR = 2
INTERRUPTED = 130


def _client(args: argparse.Namespace) -> OPDClient:
    # Lazy: CLI start-up (`opd --help`) loads no command's stack; this one loads when it runs.
    from opd_trainer.client.api_client import OPDClient

    api_key = args.api_key or os.environ.get("OPD_API_KEY")
    if not api_key:
        raise ConfigError(
            "set OPD_API_KEY or pass --api-key (make one with `opd keys create`)", field="api_key"
        )
    return OPDClient(args.base_url, api_key)


def _admin_key(args: argparse.Namespace, required: bool = True) -> str | None:
    key = args.admin_key or os.environ.get("OPD_ADMIN_KEY")
    if not key and required:
        raise ConfigError("set OPD_ADMIN_KEY or pass --admin-key", field="admin_key")
    return key


def _json_out(args: argparse.Namespace, value: Any) -> bool:
    """Prints `value` (an API model, a list of them, or plain JSON) as JSON when `-o json` was asked
    for; says whether it did."""
    if args.output != "json":
        return False
    print(json.dumps(_jsonable(value), indent=2))
    return True


def _jsonable(value: Any) -> Any:
    """The API's JSON of a client answer: its models dumped as the server sends them."""
    # Lazy: CLI start-up (`opd --help`) loads no command's stack; this one loads when it runs.
    from pydantic import BaseModel

    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    if isinstance(value, list):
        return [_jsonable(item) for item in value]
    return value


def _when(seconds: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(seconds)) if seconds else "-"


def _table(header: list[str], rows: Iterable[list[str]]) -> None:
    rows = list(rows)
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows, strict=True)]
    for row in [header, *rows]:
        print("  ".join(str(cell).ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip())


def _interrupted(job_id: str) -> int:
    print(
        f"\nstopped following; job {job_id} keeps running on the server "
        f"(`opd logs -f {job_id}` follows it again, `opd cancel {job_id}` stops it)",
        file=sys.stderr,
    )
    return INTERRUPTED


# -- jobs -----------------------------------------------------------------------------------------


def _submit(args: argparse.Namespace) -> int:
    # Lazy: CLI start-up (`opd --help`) loads no command's stack; this one loads when it runs.
    from opd_trainer.jobspec.job_spec import load_job_spec

    spec = load_job_spec(Path(args.job_file))
    client = _client(args)
    job = client.submit(spec, dry_run=args.dry_run)
    if not args.follow:
        if not _json_out(args, job):
            print(f"submitted {job.id} ({job.job_name}): {job.status}")
        return 0
    # Following with -o json: the finished job is the one JSON document on stdout.
    print(f"submitted {job.id} ({job.job_name}): {job.status}", flush=True, file=_notes(args))
    plot_dir = Path(args.plot_dir) if args.plot_dir else Path("runs") / job.id
    try:
        return _follow(args, client, job, plot_dir)
    except KeyboardInterrupt:
        return _interrupted(job.id)


def _notes(args: argparse.Namespace) -> Any:
    """Where progress lines go: stdout, or stderr when stdout carries JSON."""
    return sys.stderr if args.output == "json" else sys.stdout


def _follow(args: argparse.Namespace, client: OPDClient, job: JobPublic, plot_dir: Path) -> int:
    """A progress bar fed by the job's event stream, then the final table and curves."""
    # Lazy: CLI start-up (`opd --help`) loads no command's stack; this one loads when it runs.
    from tqdm import tqdm

    # Lazy: CLI start-up (`opd --help`) loads no command's stack; this one loads when it runs.
    from opd_trainer.client.operations import StreamEnd

    notes = _notes(args)
    bar = tqdm(total=job.total_steps or None, unit="step", dynamic_ncols=True)
    final: JobPublic | None = job
    try:
        for event in client.stream_events(job.id):
            if isinstance(event, StreamEnd):
                final = event.job
                break
            data = event.data
            if event.type == "step":
                if data.get("total_steps") and bar.total != data["total_steps"]:
                    bar.total = data["total_steps"]
                    bar.refresh()
                bar.update(max(0, int(data.get("step", bar.n)) - bar.n))
                postfix = {
                    k: f"{data[k]:.3f}" for k in ("reverse_kl", "loss") if isinstance(data.get(k), float)
                }
                bar.set_postfix(postfix)
            elif event.type != "autoscale":
                bar.write(f"[{event.type}] {event.message}", file=notes)
    finally:
        bar.close()
    if final is None:  # deleted while followed
        print(f"error: job {job.id} was deleted", file=sys.stderr)
        return 1
    if not _json_out(args, final):
        print(f"job {final.id}: {final.status}")
    if final.status != "succeeded":
        if final.error:
            field = f"{final.error.param}: " if final.error.param else ""
            print(f"error: {field}{final.error.message}", file=sys.stderr)
        return 1
    metrics = client.metrics(final.id)
    if metrics.data:
        curves = plot_curves(metrics.data, plot_dir / "curves.png", final.job_name)
        print(f"curves: {curves}", file=notes)
    if metrics.summary:
        print(format_final_table(metrics.summary), file=notes)
    if final.dry_run is not None and final.dry_run.estimate is not None:
        # Lazy: CLI start-up (`opd --help`) loads no command's stack; this one loads when it runs.
        from opd_trainer.driver.estimate import format_estimate

        print(format_estimate(final.dry_run.estimate, final.job_name), file=notes)
    return 0


def _jobs(args: argparse.Namespace) -> int:
    page = _client(args).list_jobs(status=args.status, limit=args.limit)
    if _json_out(args, page):
        return 0
    rows = []
    for job in page.data:
        steps = f"{job.step}/{job.total_steps if job.total_steps is not None else '?'}"
        rows.append([job.id, job.status, steps, _when(job.created_at), job.job_name])
    _table(["id", "status", "step", "created", "name"], rows)
    if page.has_more:
        print(f"... more: --limit {min(100, args.limit * 2)} or -o json with the API's `after` cursor")
    return 0


def _get(args: argparse.Namespace) -> int:
    print(json.dumps(_jsonable(_client(args).get_job(args.job_id)), indent=2))
    return 0


def _logs(args: argparse.Namespace) -> int:
    """Every event so far, page after page; with -f, then the live stream until the job ends."""
    # Lazy: CLI start-up (`opd --help`) loads no command's stack; this one loads when it runs.
    from opd_trainer.client.operations import StreamEnd

    client = _client(args)
    last = 0
    for event in client.iter_events(args.job_id):
        last = event.id
        _print_event(args, event)
    if not args.follow:
        return 0
    try:
        for item in client.stream_events(args.job_id, after=last):
            if isinstance(item, StreamEnd):
                if args.output != "json":
                    print(f"-- job {item.job.status if item.job else 'deleted'}")
                return 0
            _print_event(args, item)
    except KeyboardInterrupt:
        return _interrupted(args.job_id)
    return 0


def _print_event(args: argparse.Namespace, event: EventPublic) -> None:
    if args.output == "json":
        print(json.dumps(_jsonable(event)), flush=True)  # one object per line (JSON Lines)
    else:
        print(format_event_line(event.time, event.type, event.message, event.data), flush=True)


def _job_action(action: str) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        job = getattr(_client(args), f"{action}_job")(args.job_id)
        if not _json_out(args, job):
            print(f"{job.id}: {job.status}")
        return 0

    return run


def _delete(args: argparse.Namespace) -> int:
    deleted = _client(args).delete_job(args.job_id)
    if not _json_out(args, deleted):
        print(f"deleted {deleted.id}")
    return 0


def _checkpoints(args: argparse.Namespace) -> int:
    checkpoints = _client(args).checkpoints(args.job_id)
    if not _json_out(args, checkpoints):
        rows = (
            [c.id, str(c.step), _when(c.created_at), "best" if c.promoted else "", c.student]
            for c in checkpoints
        )
        _table(["id", "step", "created", "promoted", "student model folder (on the server)"], rows)
    return 0


def _download(args: argparse.Namespace) -> int:
    folder = _client(args).download_checkpoint(args.job_id, args.checkpoint, args.to, args.merged)
    if not _json_out(args, {"job_id": args.job_id, "path": str(folder)}):
        print(folder)
    return 0


METRIC_COLUMNS = ("reverse_kl", "loss", "reward_mean", "tokens_per_s")


def _metrics(args: argparse.Namespace) -> int:

    metrics = _client(args).metrics(args.job_id)
    if _json_out(args, metrics):
        return 0
    steps = [r for r in metrics.data if r.get("kind") == "train"]
    columns = [c for c in METRIC_COLUMNS if any(c in r for r in steps)]
    shown = steps if args.all else steps[-args.last :]
    _table(
        ["step", *columns],
        ([str(r["step"]), *(_number(r.get(c)) for c in columns)] for r in shown),
    )
    if metrics.summary:
        print(format_final_table(metrics.summary))
    return 0


def _number(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, int | float) else "-"


# -- files ----------------------------------------------------------------------------------------


def _files_list(args: argparse.Namespace) -> int:
    files = _client(args).list_files(purpose=args.purpose)
    if not _json_out(args, files):
        rows = ([f.id, f.purpose, str(f.bytes), _when(f.created_at), f.filename] for f in files)
        _table(["id", "purpose", "bytes", "created", "filename"], rows)
    return 0


def _files_upload(args: argparse.Namespace) -> int:
    path = Path(args.path)
    if not path.is_file() and not (args.purpose in ("workspace", "model") and path.is_dir()):
        kind = f"a file or a {args.purpose} folder" if args.purpose != "dataset" else "a file"
        raise ConfigError(f"{path} is not {kind}", field="path")
    uploaded = _client(args).upload_file(path, purpose=args.purpose)
    if not _json_out(args, uploaded):
        print(f"{uploaded.id} ({uploaded.purpose}, {uploaded.bytes} bytes): {uploaded.filename}")
    return 0


def _files_delete(args: argparse.Namespace) -> int:
    deleted = _client(args).delete_file(args.file_id)
    if not _json_out(args, deleted):
        print(f"deleted {deleted.id}")
    return 0


# -- keys -----------------------------------------------------------------------------------------


def _keys_create(args: argparse.Namespace) -> int:
    # Lazy: CLI start-up (`opd --help`) loads no command's stack; this one loads when it runs.
    from opd_trainer.client.api_client import OPDClient

    admin_key = _admin_key(args)
    with OPDClient(args.base_url, api_key="") as client:
        key = client.create_key(args.tenant, admin_key)
    if not _json_out(args, key):
        print(f"tenant {key.tenant}: key {key.id}")
        print(key.key)
    return 0


def _as_admin_or_tenant(args: argparse.Namespace, call: Callable[[Any, str | None], Any]) -> Any:
    """`call(client, admin_key)` with the admin key when one is given (every tenant's view), else
    `call(client, None)` with the tenant's key."""
    # Lazy: CLI start-up (`opd --help`) loads no command's stack; this one loads when it runs.
    from opd_trainer.client.api_client import OPDClient

    admin_key = _admin_key(args, required=False)
    if admin_key:
        with OPDClient(args.base_url, api_key="") as client:
            return call(client, admin_key)
    return call(_client(args), None)


def _usage(args: argparse.Namespace) -> int:
    tenants = _as_admin_or_tenant(args, lambda client, admin_key: client.usage(admin_key))
    if not _json_out(args, tenants):
        columns = ("teacher_tokens", "student_generated_tokens", "learner_tokens_trained", "cpu_s", "gpu_s")
        rows = ([t.tenant, t.jobs, *(f"{t.usage.get(c, 0.0):.0f}" for c in columns)] for t in tenants)
        _table(
            ["tenant", "jobs", "teacher tokens", "student tokens", "trained tokens", "CPU s", "GPU s"], rows
        )
    return 0


def _keys_list(args: argparse.Namespace) -> int:
    keys = _as_admin_or_tenant(args, lambda client, admin_key: client.list_keys(admin_key))
    if not _json_out(args, keys):
        rows = ([k.id, k.tenant, f"{k.prefix}...", _when(k.created_at)] for k in keys)
        _table(["id", "tenant", "key", "created"], rows)
    return 0


def _keys_revoke(args: argparse.Namespace) -> int:
    # Lazy: CLI start-up (`opd --help`) loads no command's stack; this one loads when it runs.
    from opd_trainer.client.api_client import OPDClient

    with OPDClient(args.base_url, api_key="") as client:
        revoked = client.revoke_key(args.key_id, _admin_key(args))
    if not _json_out(args, revoked):
        print(f"revoked {revoked.id}")
    return 0


# -- webhooks -------------------------------------------------------------------------------------


def _webhooks_create(args: argparse.Namespace) -> int:
    webhook = _client(args).create_webhook(args.url, args.event or None, args.description)
    if not _json_out(args, webhook):
        print(f"webhook {webhook.id}: {webhook.url} ({', '.join(webhook.events)})")
        print(f"signing secret (shown once): {webhook.secret}")
    return 0


def _webhooks_list(args: argparse.Namespace) -> int:
    webhooks = _client(args).list_webhooks()
    if not _json_out(args, webhooks):
        rows = ([w.id, ",".join(w.events), _when(w.created_at), w.url] for w in webhooks)
        _table(["id", "events", "created", "url"], rows)
    return 0


def _webhooks_delete(args: argparse.Namespace) -> int:
    deleted = _client(args).delete_webhook(args.webhook_id)
    if not _json_out(args, deleted):
        print(f"deleted {deleted.id}")
    return 0


def _webhooks_deliveries(args: argparse.Namespace) -> int:
    page = _client(args).webhook_deliveries(args.webhook_id, limit=args.limit, job_id=args.job)
    if _json_out(args, page):
        return 0
    rows = []
    for delivery in page.data:
        last = delivery.attempts[-1] if delivery.attempts else None
        answer = "-" if last is None else str(last.status_code or last.error or "-")
        rows.append(
            [
                delivery.id,
                delivery.event_type,
                delivery.job_id,
                delivery.status,
                str(len(delivery.attempts)),
                answer[:60],
                _when(delivery.created_at),
            ]
        )
    _table(["id", "event", "job", "status", "attempts", "last answer", "created"], rows)
    return 0


# -- error handling and registration --------------------------------------------------------------


def _guarded(handler: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """Bad input → one `error: field: message` line and exit 2; a server fault or no server → exit 1."""

    def run(args: argparse.Namespace) -> int:
        # Lazy: CLI start-up (`opd --help`) loads no command's stack; this one loads when it runs.
        import httpx

        # Lazy: CLI start-up (`opd --help`) loads no command's stack; this one loads when it runs.
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
            return INTERRUPTED

    return run


def _options(admin: bool = False) -> argparse.ArgumentParser:
    parent = argparse.ArgumentParser(add_help=False)
    parent.add_argument("--base-url", help="job server URL (default $OPD_BASE_URL or http://127.0.0.1:8000)")
    parent.add_argument("--api-key", help="tenant key (default $OPD_API_KEY)")
    if admin:
        parent.add_argument("--admin-key", help="the server's admin key (default $OPD_ADMIN_KEY)")
    parent.add_argument(
        "-o", "--output", choices=("text", "json"), default="text", help="text (default) or the API's JSON"
    )
    return parent


def add_client_commands(commands: Any) -> None:
    """Registers the client commands on `opd`'s subparsers."""
    connection, admin = _options(), _options(admin=True)
    _add_job_commands(commands, connection, admin)
    _add_file_commands(commands, connection)
    _add_key_commands(commands, admin)
    _add_webhook_commands(commands, connection)


def _add_job_commands(commands: Any, connection: Any, admin: Any) -> None:
    """submit, jobs, get, logs, cancel/pause/resume, delete, checkpoints, download, metrics, usage."""

    def command(name: str, help_text: str, handler: Callable[[argparse.Namespace], int], **kw: Any) -> Any:
        parser = commands.add_parser(name, parents=[kw.pop("parent", connection)], help=help_text)
        parser.set_defaults(handler=_guarded(handler))
        return parser

    submit = command("submit", "upload a job's files and submit it", _submit)
    submit.add_argument("job_file", help="job spec, YAML or JSON (local paths are uploaded)")
    submit.add_argument("--follow", action="store_true", help="show progress until the job finishes")
    submit.add_argument("--plot-dir", help="where --follow writes curves.png (default runs/JOB_ID)")
    submit.add_argument(
        "--dry-run",
        action="store_true",
        help="run a short calibration of the job instead, for an estimate of what the whole job would use "
        "(shown by --follow and in the job's dry_run.estimate)",
    )

    jobs = command("jobs", "list your jobs, newest first", _jobs)
    jobs.add_argument("--status", help="only jobs in this status")
    jobs.add_argument("--limit", type=int, default=20, help="how many (at most 100)")

    command("get", "show one job as JSON", _get).add_argument("job_id")

    logs = command("logs", "a job's event log, every event so far", _logs)
    logs.add_argument("job_id")
    logs.add_argument("-f", "--follow", action="store_true", help="then stream until the job finishes")

    for action, help_text in (
        ("cancel", "cancel a job (a running one stops after its current step)"),
        ("pause", "pause a job after its current step, with a checkpoint"),
        ("resume", "queue a paused job again; it resumes from its latest checkpoint"),
    ):
        command(action, help_text, _job_action(action)).add_argument("job_id")
    command("delete", "delete a finished job and its run directory", _delete).add_argument("job_id")
    command("checkpoints", "a job's checkpoints", _checkpoints).add_argument("job_id")
    download = command("download", "download a trained student as a Hugging Face model folder", _download)
    download.add_argument("job_id")
    download.add_argument("--checkpoint", help="checkpoint id (default: the job's fine_tuned_model)")
    download.add_argument("--to", help="folder to create (default ./JOB_ID-CHECKPOINT_ID)")
    download.add_argument(
        "--merged",
        action="store_true",
        help="a LoRA job's checkpoint as its base model with the adapter merged in (default: the adapter)",
    )
    metrics = command("metrics", "a job's training metrics and validation summary", _metrics)
    metrics.add_argument("job_id")
    metrics.add_argument("--last", type=int, default=10, help="how many of the latest steps (default 10)")
    metrics.add_argument("--all", action="store_true", help="every step")

    usage_help = (
        "what your jobs used (tokens, CPU/GPU-seconds), deleted ones too; all tenants' with --admin-key"
    )
    command("usage", usage_help, _usage, parent=admin)


def _add_file_commands(commands: Any, connection: Any) -> None:
    """files list | upload | delete."""
    files = commands.add_parser("files", help="uploaded datasets, workspaces and models")
    file_commands = files.add_subparsers(dest="files_command", required=True)
    listing = file_commands.add_parser("list", parents=[connection], help="your files")
    listing.add_argument("--purpose", choices=("dataset", "workspace", "model"), help="only this kind")
    listing.set_defaults(handler=_guarded(_files_list))
    upload = file_commands.add_parser(
        "upload", parents=[connection], help="upload a dataset, a workspace or a model"
    )
    upload.add_argument(
        "path", help="a JSONL dataset, a workspace folder or .zip, or a Hugging Face model folder or .zip"
    )
    upload.add_argument(
        "--purpose",
        choices=("dataset", "workspace", "model"),
        default="dataset",
        help="default dataset; a model's file id can be a job's model or teacher_model",
    )
    upload.set_defaults(handler=_guarded(_files_upload))
    remove = file_commands.add_parser("delete", parents=[connection], help="delete a file")
    remove.add_argument("file_id")
    remove.set_defaults(handler=_guarded(_files_delete))


def _add_key_commands(commands: Any, admin: Any) -> None:
    """keys create | list | revoke."""
    keys = commands.add_parser("keys", help="API keys")
    key_commands = keys.add_subparsers(dest="keys_command", required=True)
    create = key_commands.add_parser("create", parents=[admin], help="create a tenant key (admin key)")
    create.add_argument("--tenant", required=True, help="tenant name (created on first use)")
    create.set_defaults(handler=_guarded(_keys_create))
    key_list = key_commands.add_parser(
        "list", parents=[admin], help="your keys; every tenant's with the admin key (secrets never shown)"
    )
    key_list.set_defaults(handler=_guarded(_keys_list))
    revoke = key_commands.add_parser("revoke", parents=[admin], help="revoke a key at once (admin key)")
    revoke.add_argument("key_id")
    revoke.set_defaults(handler=_guarded(_keys_revoke))


def _add_webhook_commands(commands: Any, connection: Any) -> None:
    """webhooks create | list | delete | deliveries."""
    hooks = commands.add_parser("webhooks", help="webhook endpoints: job status changes POSTed to your URL")
    hook_commands = hooks.add_subparsers(dest="webhooks_command", required=True)
    hook_create = hook_commands.add_parser(
        "create", parents=[connection], help="register an endpoint (its signing secret is shown once)"
    )
    hook_create.add_argument("url", help="an https URL on the public internet")
    hook_create.add_argument(
        "--event",
        action="append",
        choices=("job.running", "job.paused", "job.succeeded", "job.failed", "job.cancelled"),
        help="an event to send (repeat it for several; default all)",
    )
    hook_create.add_argument("--description", default="", help="a note for people")
    hook_create.set_defaults(handler=_guarded(_webhooks_create))
    hook_list = hook_commands.add_parser("list", parents=[connection], help="your endpoints")
    hook_list.set_defaults(handler=_guarded(_webhooks_list))
    hook_delete = hook_commands.add_parser("delete", parents=[connection], help="delete an endpoint")
    hook_delete.add_argument("webhook_id")
    hook_delete.set_defaults(handler=_guarded(_webhooks_delete))
    hook_log = hook_commands.add_parser(
        "deliveries", parents=[connection], help="an endpoint's deliveries and their attempts, newest first"
    )
    hook_log.add_argument("webhook_id")
    hook_log.add_argument("--job", help="only this job's deliveries")
    hook_log.add_argument("--limit", type=int, default=20, help="how many (at most 100)")
    hook_log.set_defaults(handler=_guarded(_webhooks_deliveries))
