"""`EngineStats` (vLLM's per-engine stat-logger hook) and how a role's replicas combine; vLLM's own
stats objects, no engine."""

from __future__ import annotations

from vllm.v1.metrics.stats import IterationStats, PrefixCacheStats, SchedulerStats

from opd_trainer.engine.engine_stats import EngineStats, combine


def _scheduler(running: int, waiting: int, usage: float, queries: int, hits: int) -> SchedulerStats:
    return SchedulerStats(
        num_running_reqs=running,
        num_waiting_reqs=waiting,
        kv_cache_usage=usage,
        prefix_cache_stats=PrefixCacheStats(requests=1, queries=queries, hits=hits),
    )


def _iteration(generated: int, preempted: int = 0) -> IterationStats:
    stats = IterationStats()
    stats.num_generation_tokens = generated
    stats.num_preempted_reqs = preempted
    return stats


def test_totals_add_up_and_peaks_restart_after_each_read() -> None:
    stats = EngineStats()
    stats.record(_scheduler(4, 2, 0.5, queries=600, hits=512), _iteration(4))
    stats.record(_scheduler(8, 0, 0.25, queries=0, hits=0), _iteration(8, preempted=1))
    first = stats.read()
    assert first["generation_tokens"] == 12 and first["preemptions"] == 1
    assert first["prefix_cache_queries"] == 600 and first["prefix_cache_hits"] == 512
    assert (first["running_max"], first["waiting_max"], first["kv_cache_usage_max"]) == (8, 2, 0.5)
    stats.record(_scheduler(1, 0, 0.1, queries=0, hits=0), None)
    second = stats.read()
    assert second["generation_tokens"] == 12  # totals keep counting
    assert (second["running_max"], second["kv_cache_usage_max"]) == (1, 0.1)  # peaks since the last read


def test_a_role_adds_its_replicas_totals_and_keeps_the_fullest_kv_cache() -> None:
    replicas = [
        {
            "generation_tokens": 10.0,
            "prefix_cache_queries": 100.0,
            "prefix_cache_hits": 50.0,
            "running_max": 2.0,
            "kv_cache_usage_max": 0.3,
        },
        {
            "generation_tokens": 5.0,
            "prefix_cache_queries": 300.0,
            "prefix_cache_hits": 250.0,
            "running_max": 1.0,
            "kv_cache_usage_max": 0.7,
        },
    ]
    combined = combine(replicas)
    assert combined["generation_tokens"] == 15 and combined["running_max"] == 3
    assert combined["kv_cache_usage_max"] == 0.7
    assert combined["prefix_cache_hit_rate"] == 300 / 400
    assert combine([EngineStats().read()])["prefix_cache_hit_rate"] == 0.0
