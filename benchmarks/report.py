"""One table from the latest benchmark results (benchmarks/results/*.json), each row a ratio and its target.

Run by `make bench` after the benchmarks; a row whose result file is missing says which script makes it.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

Row = tuple[str, str, str, str]  # what, measured, target, source

# (result file, what, value of the result, target) — one line per headline number.
ROWS: list[tuple[str, str, Callable[[dict[str, Any]], str], str]] = [
    (
        "engine_throughput",
        "sampling: engine actor / raw vllm.LLM",
        lambda r: f"{r['generate_ratio']:.2f}x",
        ">= 0.9x",
    ),
    (
        "engine_throughput",
        "sampling: engine actor / raw vllm.LLM with logprobs=0",
        lambda r: f"{r['generate_ratio_same_work']:.2f}x",
        "—",
    ),
    (
        "engine_throughput",
        "teacher scoring: actor / raw prompt logprobs",
        lambda r: f"{r['score_ratio']:.2f}x",
        ">= 0.9x",
    ),
    (
        "engine_throughput",
        "teacher scoring with top-k / sampled token only",
        lambda r: f"{r['top_k_score_over_sampled']:.2f}x (k={r['teacher_top_k']})",
        "<= 1.3x",
    ),
    (
        "engine_throughput",
        "weight sync / one memory copy",
        lambda r: f"{r['weight_update_over_copy']:.1f}x slower",
        "—",
    ),
    (
        "rollout_gateway",
        "rollout via pool + gateway / raw engine",
        lambda r: f"{r['throughput_ratio']:.2f}x",
        ">= 0.9x",
    ),
    (
        "rollout_gateway",
        "built-in (Model OPD) rollout via gateway / raw engine",
        lambda r: f"{r['builtin_throughput_ratio']:.2f}x",
        "—",
    ),
    (
        "step_breakdown",
        "step overhead (not rollout/teacher/learner/sync)",
        lambda r: f"{r['parts_percent']['other']:.1f}%",
        "<= 10%",
    ),
    (
        "step_breakdown",
        "learner FLOP rate / measured matmul rate",
        lambda r: f"{r['learner_fraction_of_matmul_limit']:.1%}",
        "—",
    ),
    (
        "api_load",
        "API p99, reads (200 pollers)",
        lambda r: f"{max(x['p99_ms'] for x in r['rows'] if x['operation'].startswith('poll')):.0f} ms",
        "< 200 ms",
    ),
    (
        "staleness",
        "samples/s: max_staleness 1 / 0",
        lambda r: f"{r['samples_per_s_ratio']:.2f}x",
        "—",
    ),
    (
        "api_load",
        "API 5xx",
        lambda r: str(sum(x["server_errors_5xx"] for x in r["rows"])),
        "0",
    ),
    (
        "vs_trl_gkd",
        "samples/s: ours / TRL GKD",
        lambda r: f"{r['compare']['samples_per_s_ratio']:.2f}x",
        ">= 1x (CPU)",
    ),
    (
        "vs_trl_gkd",
        "time to same accuracy: TRL / ours",
        lambda r: (
            f"{r['compare']['time_to_target_ratio']:.2f}x"
            if r["compare"]["time_to_target_ratio"]
            else "not reached"
        ),
        ">= 1x (CPU)",
    ),
    (
        "vs_trl_gkd",
        "crossover batch (ours not slower)",
        lambda r: _crossover(r.get("crossover")),
        "—",
    ),
    (
        "efficacy",
        "OPD: gap closed (mean over seeds)",
        lambda r: f"{_opd(r)['gap_closed']:.0%} ({_opd_name(r)})",
        ">= 90%",
    ),
    (
        "efficacy",
        "OPD: training s to 90% of the gap",
        lambda r: (
            f"{_opd(r)['train_s_to_90']:.0f} s" if _opd(r)["train_s_to_90"] is not None else "not reached"
        ),
        "<= 600 s",
    ),
    (
        "efficacy",
        "steps to 90% of the gap: RL / OPD",
        lambda r: _steps_ratio(r, "90"),
        ">= 5x",
    ),
    (
        "efficacy",
        "steps to 50% of the gap: RL / OPD",
        lambda r: _steps_ratio(r, "50"),
        ">= 5x",
    ),
]


def _crossover(crossover: dict[str, Any] | None) -> str:
    if not crossover or not crossover["rows"]:
        return "not measured"
    if crossover["crossover_batch"] is None:
        return "none: slower at " + ", ".join(str(row["batch"]) for row in crossover["rows"])
    return str(crossover["crossover_batch"])


def _opd_name(result: dict[str, Any]) -> str:
    """Efficacy's headline OPD arm (older result files have only `opd`)."""
    return str(result.get("headline_opd_arm") or "opd")


def _opd(result: dict[str, Any]) -> dict[str, Any]:
    return result["arms"][_opd_name(result)]  # type: ignore[no-any-return]


def _steps_ratio(result: dict[str, Any], tag: str) -> str:
    opd, rl = result["arms"].get(_opd_name(result)), result["arms"].get("rl")
    if not opd or not rl or opd[f"steps_to_{tag}"] is None:
        return "OPD not reached"
    reached = f"(seeds: OPD {opd[f'seeds_reaching_{tag}']}, RL {rl[f'seeds_reaching_{tag}']})"
    if rl[f"steps_to_{tag}"] is None:
        return f"> {result['settings']['steps'] / opd[f'steps_to_{tag}']:.1f}x, RL not reached {reached}"
    return f"{rl[f'steps_to_{tag}'] / opd[f'steps_to_{tag}']:.1f}x {reached}"


def rows(results_dir: Path) -> list[Row]:
    out: list[Row] = []
    for name, what, value, target in ROWS:
        path = results_dir / f"{name}.json"
        if not path.exists():
            out.append((what, "not run", target, f"benchmarks/{name}.py"))
            continue
        try:
            measured = value(json.loads(path.read_text()))
        except (KeyError, TypeError, ValueError) as exc:
            measured = f"unreadable ({type(exc).__name__}: {exc})"
        out.append((what, measured, target, f"benchmarks/{name}.py"))
    return out


def format_table(table: list[Row]) -> str:
    widths = [
        max(len(row[i]) for row in [("what", "measured", "target", "source"), *table]) for i in range(4)
    ]
    lines = [
        "  ".join(h.ljust(w) for h, w in zip(("what", "measured", "target", "source"), widths, strict=True))
    ]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)) for row in table]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    print(format_table(rows(args.results)))


if __name__ == "__main__":
    main()
