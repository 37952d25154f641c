"""Starts or joins Ray: an embedded local Ray by default, a cluster when RAY_ADDRESS is set."""

from __future__ import annotations

import atexit
import logging
import os
from pathlib import Path

import ray
from ray._private import worker

from opd_trainer.cluster.ray_reaper import remove_runtime_resources, start_reaper

__all__ = [
    "LOCAL_CPU_SLOTS",
    "embedded_ray",
    "embedded_session_dir",
    "init_ray",
    "remove_runtime_resources",
    "shutdown_ray",
]

logger = logging.getLogger(__name__)

# Ray CPU slots are scheduling tokens, not cores. Engines, the learner and the worker pools each take
# slots; on a 2-core laptop they still all fit, and the OS shares the real cores among them.
LOCAL_CPU_SLOTS = 16


def embedded_ray(address: str | None = None) -> bool:
    """Whether `init_ray(address)` starts a local Ray of this process rather than joining a cluster
    (no address, or Ray's own word for a new local one, `local`)."""
    return (address or os.environ.get("RAY_ADDRESS") or "local") == "local"


def init_ray(address: str | None = None, reap_on_exit: bool = False) -> None:
    """Idempotent: joins `address` (or $RAY_ADDRESS) if given, else starts a local Ray.

    `reap_on_exit`: a local Ray's processes are ended when this process dies, even by SIGKILL
    (`opd_trainer.cluster.ray_reaper`); for long-lived owners such as `opd serve`.
    """
    if ray.is_initialized():
        return
    if not embedded_ray(address):
        address = address or os.environ["RAY_ADDRESS"]
        ray.init(address=address, logging_level=logging.WARNING)
        logger.info("joined Ray cluster at %s", address)
        return
    ray.init(
        # Always a new Ray of this process: never a stray local cluster another process left running.
        address="local",
        num_cpus=max(LOCAL_CPU_SLOTS, os.cpu_count() or 1),
        include_dashboard=False,
        logging_level=logging.WARNING,
        # Engine subprocesses log a lot at INFO; keep the driver's terminal for progress output.
        log_to_driver=os.environ.get("OPD_RAY_LOG_TO_DRIVER", "0") == "1",
    )
    logger.info("started local Ray with %d CPU slots", max(LOCAL_CPU_SLOTS, os.cpu_count() or 1))
    session_dir = embedded_session_dir()
    # Registered after ray.init's own atexit hook, so it runs first: Ray ends, then its built envs go.
    atexit.unregister(shutdown_ray)
    atexit.register(shutdown_ray)
    if reap_on_exit:
        start_reaper(session_dir=session_dir)


def embedded_session_dir() -> Path | None:
    """The session folder (`/tmp/ray/session_*`) of the Ray this process started, None when it joined one."""
    node = worker._global_node
    return Path(node.get_session_dir_path()) if node is not None and node.head else None


def shutdown_ray() -> None:
    """Stops Ray; when this process had started it, also removes its runtime environments."""
    if not ray.is_initialized():
        return
    session_dir = embedded_session_dir()
    ray.shutdown()
    remove_runtime_resources(session_dir)
