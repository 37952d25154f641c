"""What a vLLM engine did, from vLLM's own stat-logger hook, for step metrics and Prometheus.

`EngineStats` is a per-engine stat logger for `AsyncLLM.from_engine_args(stat_loggers=[...])`: vLLM
calls `record` with its scheduler and iteration stats after each engine step. It has the methods of
`vllm.v1.metrics.loggers.StatLoggerBase` without subclassing it, so that the driver, which only combines
the numbers, does not import vLLM (seconds and hundreds of MB). It keeps running totals (prompt and
generated tokens, prefix-cache queries and hits, preemptions, finished requests, scoring requests
rerun without the prefix cache or completed from an earlier request's rows) and the peaks of the live
numbers (requests running and waiting, KV-cache usage) since they were last read. `EngineGroup.stats`
sums a role's replicas; the driver adds them to each step's metrics as `engine/ROLE/KEY`, and the job
server exports them (`opd_job_engine_*`).

vLLM says its `SchedulerStats` / `IterationStats` are not a stable interface: this module is the one
place that reads them (vLLM is pinned in pyproject.toml).
"""

from __future__ import annotations

import threading
from typing import Any

TOTALS = (
    "prompt_tokens",
    "generation_tokens",
    "prefix_cache_queries",
    "prefix_cache_hits",
    "preemptions",
    "requests_finished",
    "scores_rescored",
    "scores_reused",
)
PEAKS = ("running_max", "waiting_max", "kv_cache_usage_max")


class EngineStats:
    """Running totals and peaks of one engine (see the module docstring)."""

    def __init__(self, vllm_config: Any = None, engine_index: int = 0) -> None:
        self.engine_index = engine_index
        self.totals = dict.fromkeys(TOTALS, 0.0)
        self.peaks = dict.fromkeys(PEAKS, 0.0)
        self.reader_peaks: dict[str, dict[str, float]] = {}  # a shared engine's per-job peaks
        # vLLM records from the thread that steps an in-process engine core (`inproc_llm`); the
        # engine actor reads from its event loop.
        self._lock = threading.Lock()

    def record(
        self,
        scheduler_stats: Any,
        iteration_stats: Any,
        mm_cache_stats: Any = None,
        engine_idx: int = 0,
    ) -> None:
        with self._lock:
            self._record(scheduler_stats, iteration_stats)

    def _record(self, scheduler_stats: Any, iteration_stats: Any) -> None:
        if scheduler_stats is not None:
            now = {
                "running_max": scheduler_stats.num_running_reqs,
                "waiting_max": scheduler_stats.num_waiting_reqs,
                "kv_cache_usage_max": scheduler_stats.kv_cache_usage,
            }
            for peaks in (self.peaks, *self.reader_peaks.values()):
                for key, value in now.items():
                    peaks[key] = max(peaks[key], float(value))
            prefix = scheduler_stats.prefix_cache_stats
            if prefix is not None:
                self.totals["prefix_cache_queries"] += prefix.queries
                self.totals["prefix_cache_hits"] += prefix.hits
        if iteration_stats is not None:
            self.totals["prompt_tokens"] += iteration_stats.num_prompt_tokens
            self.totals["generation_tokens"] += iteration_stats.num_generation_tokens
            self.totals["preemptions"] += iteration_stats.num_preempted_reqs
            self.totals["requests_finished"] += len(iteration_stats.finished_requests)

    def count_rescore(self) -> None:
        """A teacher-forcing request scored a second time, without the prefix cache (see
        `Engine._prompt_logprobs`): the cache had covered some of its completion."""
        with self._lock:
            self.totals["scores_rescored"] += 1

    def count_reuse(self) -> None:
        """A teacher-forcing request whose positions hidden by the prefix cache took an earlier
        request's rows for the same tokens (`recent_scores`) instead of a second run."""
        with self._lock:
            self.totals["scores_reused"] += 1

    def log_engine_initialized(self) -> None:
        pass

    def log(self) -> None:
        pass

    def record_sleep_state(self, is_awake: int, level: int) -> None:
        pass

    def read(self) -> dict[str, float]:
        """Totals so far and the peaks since the last read (which starts new peaks)."""
        with self._lock:
            snapshot = {**self.totals, **self.peaks}
            self.peaks = dict.fromkeys(PEAKS, 0.0)
        return snapshot

    def read_peaks(self, reader: str) -> dict[str, float]:
        """The peaks since `reader`'s last call (each job on a shared engine reads its own)."""
        with self._lock:
            peaks = self.reader_peaks.get(reader, dict.fromkeys(PEAKS, 0.0))
            self.reader_peaks[reader] = dict.fromkeys(PEAKS, 0.0)
        return peaks


def combine(replicas: list[dict[str, float]]) -> dict[str, float]:
    """A role's numbers from its replicas' `read()`s: totals and counts add up, KV-cache usage is the
    largest replica's, and the prefix-cache hit rate is hits over queries of them all (0 without any)."""
    added = (*TOTALS, "running_max", "waiting_max")
    combined = {key: sum(r.get(key, 0.0) for r in replicas) for key in added}
    combined["kv_cache_usage_max"] = max((r.get("kv_cache_usage_max", 0.0) for r in replicas), default=0.0)
    queries = combined["prefix_cache_queries"]
    combined["prefix_cache_hit_rate"] = combined["prefix_cache_hits"] / queries if queries else 0.0
    return combined
