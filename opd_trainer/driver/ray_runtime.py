"""Starts or joins Ray: an embedded local Ray by default, a cluster when RAY_ADDRESS is set."""

from __future__ import annotations

import logging
import os

import ray

logger = logging.getLogger(__name__)

# Ray CPU slots are scheduling tokens, not cores. Engines, the learner and the worker pools each take
# slots; on a 2-core laptop they still all fit, and the OS shares the real cores among them.
LOCAL_CPU_SLOTS = 16


def embedded_ray(address: str | None = None) -> bool:
    """Whether `init_ray(address)` starts a local Ray of this process rather than joining a cluster."""
    return not (address or os.environ.get("RAY_ADDRESS"))


def init_ray(address: str | None = None, reap_on_exit: bool = False) -> None:
    """Idempotent: joins `address` (or $RAY_ADDRESS) if given, else starts a local Ray.

    `reap_on_exit`: a local Ray's processes are ended when this process dies, even by SIGKILL
    (`opd_trainer.driver.ray_reaper`); for long-lived owners such as `opd serve`.
    """
    if ray.is_initialized():
        return
    if not embedded_ray(address):
        address = address or os.environ["RAY_ADDRESS"]
        ray.init(address=address, logging_level=logging.WARNING)
        logger.info("joined Ray cluster at %s", address)
        return
    ray.init(
        num_cpus=max(LOCAL_CPU_SLOTS, os.cpu_count() or 1),
        include_dashboard=False,
        logging_level=logging.WARNING,
        # Engine subprocesses log a lot at INFO; keep the driver's terminal for progress output.
        log_to_driver=os.environ.get("OPD_RAY_LOG_TO_DRIVER", "0") == "1",
    )
    logger.info("started local Ray with %d CPU slots", max(LOCAL_CPU_SLOTS, os.cpu_count() or 1))
    if reap_on_exit:
        from opd_trainer.driver.ray_reaper import start_reaper

        start_reaper()
