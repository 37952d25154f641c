"""CPU-seconds of a process and everything it started, for metering (`driver/metering.py`).

Each actor of a job (engine, learner rank, gateway, processor worker) reports its own process tree:
an engine's vLLM core and a processor worker's sandboxed user process are its children. Children that
exited and were waited for count too (the kernel adds them to their parent's `children_*` times).
"""

from __future__ import annotations

import psutil


def process_tree_cpu_seconds(pid: int | None = None) -> float:
    """User + system CPU-seconds of process `pid` (default: this one), its live descendants and the
    children it has reaped; 0.0 when the process is gone."""
    try:
        root = psutil.Process(pid)
        times = root.cpu_times()
        total = times.user + times.system + times.children_user + times.children_system
        descendants = root.children(recursive=True)
    except psutil.Error:
        return 0.0
    for child in descendants:
        try:
            child_times = child.cpu_times()
        except psutil.Error:
            continue  # ended between the listing and the read
        total += child_times.user + child_times.system
        total += child_times.children_user + child_times.children_system
    return total


def actor_usage() -> dict[str, float]:
    """What the calling Ray actor uses: `cpu_s` (its process tree so far) and `gpus` (the GPUs Ray
    assigned it, fractions included; 0 on a CPU node)."""
    # Lazy: called only inside Ray actors; metering's other readers (the CLI's estimate) need no Ray.
    import ray

    assigned = ray.get_runtime_context().get_assigned_resources()
    return {"cpu_s": process_tree_cpu_seconds(), "gpus": float(assigned.get("GPU", 0.0))}
