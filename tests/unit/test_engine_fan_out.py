"""`EngineGroup._fan_out`: requests spread over the replicas, answers in input order (no Ray)."""

from __future__ import annotations

import asyncio
from typing import Any

from opd_trainer.engine.vllm_engine import EngineGroup


def _fan_out(group: EngineGroup, items: list[int]) -> tuple[list[Any], list[tuple[str, list[int]]]]:
    calls: list[tuple[str, list[int]]] = []

    async def call(replica: Any, chunk: list[int]) -> list[tuple[str, int]]:
        calls.append((replica, chunk))
        return [(replica, item) for item in chunk]

    return asyncio.run(group._fan_out(items, call)), calls


def test_answers_come_back_in_input_order_and_idle_replicas_are_not_called() -> None:
    group = EngineGroup(["a", "b", "c"])
    out, calls = _fan_out(group, [10, 11, 12, 13])
    assert out == [("a", 10), ("b", 11), ("c", 12), ("a", 13)]
    assert calls == [("a", [10, 13]), ("b", [11]), ("c", [12])]
    out, calls = _fan_out(group, [])
    assert out == [] and calls == []


def test_small_batches_rotate_over_the_replicas() -> None:
    # One rollout's calls at a time (scored as each rollout ends) still reach every replica evenly.
    group = EngineGroup(["a", "b", "c"])
    replicas = [_fan_out(group, [index])[0][0][0] for index in range(6)]
    assert replicas == ["a", "b", "c", "a", "b", "c"]
