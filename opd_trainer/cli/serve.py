"""`opd serve`: the job server (the client commands are in `client_commands.py`).

Launch: `opd serve --data-dir ./opd-data` (API + embedded local Ray; `--ray-address` joins a cluster),
then `OPD_ADMIN_KEY=... opd keys create --tenant me`, `export OPD_API_KEY=...`,
`opd submit examples/model_opd_tiny/job.yaml --follow`. A bad setting, or a port another process holds,
prints one `error: field: message` line and exits 2.
"""

from __future__ import annotations

import argparse
import socket
import sys
from typing import Any

USAGE_ERROR = 2


# -- opd serve ------------------------------------------------------------------------------------

# After SIGTERM/SIGINT, requests still open this long are cancelled (streams end by themselves sooner).
GRACEFUL_SHUTDOWN_S = 10


def listening_socket(host: str, port: int) -> socket.socket:
    """The server's socket, bound and listening on `host:port` (raises OSError when it is taken).

    Opened before anything else starts: the embedded Ray binds dozens of ports of its own on start-up,
    and one of them could otherwise take the server's port before uvicorn binds it (a test's free port
    was once answered by a Ray process). Connections that arrive before uvicorn serves wait in the
    backlog. Not inherited by the processes the server starts (Python's sockets are not)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: restart at once
        sock.bind((host, port))
        sock.listen(2048)  # uvicorn's default backlog
    except OSError:
        sock.close()
        raise
    return sock


def _serve(args: argparse.Namespace) -> int:
    try:
        sock = listening_socket(args.host, args.port)
    except OSError as exc:
        reason = exc.strerror or exc
        print(f"error: --port: cannot listen on {args.host}:{args.port}: {reason}", file=sys.stderr)
        return USAGE_ERROR
    try:
        return _serve_on(sock, args)
    finally:
        sock.close()


def _serve_on(sock: socket.socket, args: argparse.Namespace) -> int:
    # Lazy: CLI start-up (`opd --help`) loads no command's stack; this one loads when it runs.
    import uvicorn
    from pydantic import ValidationError

    # Lazy: CLI start-up (`opd --help`) loads no command's stack; this one loads when it runs.
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
        # Lazy: CLI start-up (`opd --help`) loads no command's stack; this one loads when it runs.
        from opd_trainer.cluster.ray_runtime import init_ray

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
    uvicorn.Server(config).run(sockets=[sock])
    return 0


def add_server_commands(commands: Any) -> None:
    """Registers `serve` on `opd`'s subparsers."""
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
