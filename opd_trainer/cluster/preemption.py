"""Preemption notices: a node about to go (a spot node drained, a pod evicted) says so before it does.

Kubernetes gives a pod its grace period before it kills it: the worker pods' `preStop` hook (the Helm
chart's `ray.common.preemptionNoticeSeconds`) runs `opd preemption-notice` on the node, which posts a
notice under the node's Ray id in Ray's key-value store (`post_notice`) and then waits out the grace, so
the pod stays up meanwhile. A job's driver reads the notices at every step boundary (`notices`): when a
node holding one of its engines, learner ranks or gateway hosts has one, it checkpoints the step it has
just finished at once, so the recovery that follows the node's loss (`driver/recovery.py`) resumes from
there instead of from the last periodic checkpoint.

A notice is acted on at the end of the step under way: the grace must cover a step and a checkpoint.
Ray's own SIGTERM handler ends a worker process at once, so a signal to a Ray worker itself is no
notice; the node's hook is.
"""

from __future__ import annotations

import json
import time
from typing import Any

from ray.experimental import internal_kv

NOTICE_PREFIX = "opd/preemption/"
NOTICE_NAMESPACE = "opd"
NOTICE_TTL_S = 3600.0  # older notices are of nodes long gone: ignored


def post_notice(node_id: str, grace_s: float, reason: str = "preempted") -> dict[str, Any]:
    """Posts that the Ray node `node_id` goes away within `grace_s` seconds (needs a connected Ray)."""
    notice = {"node_id": node_id, "time": time.time(), "grace_s": grace_s, "reason": reason}
    key = (NOTICE_PREFIX + node_id).encode()
    internal_kv._internal_kv_put(key, json.dumps(notice).encode(), overwrite=True, namespace=NOTICE_NAMESPACE)
    return notice


def withdraw_notice(node_id: str) -> None:
    """Removes the notice of `node_id` (the node stays after all, e.g. a drain that was cancelled)."""
    internal_kv._internal_kv_del((NOTICE_PREFIX + node_id).encode(), namespace=NOTICE_NAMESPACE)


def notices() -> dict[str, dict[str, Any]]:
    """The current notices by node id (needs a connected Ray)."""
    found: dict[str, dict[str, Any]] = {}
    keys = internal_kv._internal_kv_list(NOTICE_PREFIX.encode(), namespace=NOTICE_NAMESPACE) or []
    for key in keys:
        value = internal_kv._internal_kv_get(key, namespace=NOTICE_NAMESPACE)
        try:
            notice = json.loads(value) if value else None
        except json.JSONDecodeError:
            continue
        if isinstance(notice, dict) and time.time() - float(notice.get("time", 0)) < NOTICE_TTL_S:
            found[str(notice.get("node_id"))] = notice
    return found


def notify_from_this_node(address: str, grace_s: float, reason: str, wait: bool) -> dict[str, Any]:
    """`opd preemption-notice`: joins the Ray cluster at `address` from this node, posts the notice of
    this node and, with `wait`, stays until the grace is over (the pod's preStop hook holds the pod)."""
    import ray

    ray.init(address=address, logging_level="ERROR", log_to_driver=False)
    try:
        notice = post_notice(ray.get_runtime_context().get_node_id(), grace_s, reason)
    finally:
        ray.shutdown()
    print(f"preemption notice posted for Ray node {notice['node_id']} (grace {grace_s:g}s)", flush=True)
    if wait:
        time.sleep(grace_s)
    return notice
