"""Starting a job's driver from a process that does not hold the training stack.

The job server's pod (the Docker `api` target) has no torch, vLLM or DeepSpeed, and
`opd_trainer.driver.job_driver` imports them. So the server never imports it: `launch_driver` runs a
small Ray task on the cluster, whose workers have the full stack, that creates the named, detached
driver actor there; the server then holds it by name (`ray.get_actor`), and calling its methods needs
no class. This module imports nothing but Ray (the rest only for type checkers).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import ray

if TYPE_CHECKING:
    from ray.actor import ActorHandle

    from opd_trainer.engine.engine_sharing import EngineSharing
    from opd_trainer.jobspec.job_spec import JobSpec


@ray.remote(num_cpus=0)
def _create_driver(
    spec: JobSpec,
    run_dir: str,
    job_id: str,
    storage_token: str | None,
    name: str,
    namespace: str,
    teacher_sharing: EngineSharing | None,
    student_sharing: EngineSharing | None,
) -> None:
    # Lazy: runs in a Ray task on the cluster: the server that imports launch has no torch/vLLM.
    from opd_trainer.driver.job_driver import JobDriverActor

    JobDriverActor.options(  # type: ignore[attr-defined]
        name=name, namespace=namespace, lifetime="detached", num_cpus=0
    ).remote(
        spec,
        run_dir,
        job_id,
        storage_token,
        server=True,  # tenants' code: sandboxed or refused
        teacher_sharing=teacher_sharing,
        student_sharing=student_sharing,
    )


NAME_LOOKUP_S = 30.0


def launch_driver(
    spec: JobSpec,
    run_dir: str,
    job_id: str,
    storage_token: str | None,
    name: str,
    namespace: str,
    teacher_sharing: EngineSharing | None = None,
    student_sharing: EngineSharing | None = None,
) -> ActorHandle:
    """A new detached driver actor named `name` in `namespace`; returns its handle (a `JobDriver`'s
    methods: `run`, `progress`, `events`, `request_stop`).
    `teacher_sharing`, `student_sharing`: the server's `EngineSharing` of each role
    (`engine/shared_engines.py`), None: off."""
    ray.get(
        _create_driver.remote(
            spec, run_dir, job_id, storage_token, name, namespace, teacher_sharing, student_sharing
        )
    )
    # Ray may register a new actor's name a moment after `.remote()` returned in the task.
    deadline = time.monotonic() + NAME_LOOKUP_S
    while True:
        try:
            return ray.get_actor(name, namespace=namespace)
        except ValueError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
