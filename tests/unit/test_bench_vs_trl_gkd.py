"""benchmarks/vs_trl_gkd.py's pure parts (no run): our side gets the seed, the best-setting rule, the
A/B order, and repeat.py's figures read from one-run results."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import repeat  # noqa: E402
import vs_trl_gkd  # noqa: E402


def test_our_side_gets_the_seed(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    seen: list[Any] = []
    monkeypatch.chdir(ROOT)  # the example job's paths are relative to the repository
    monkeypatch.setattr(vs_trl_gkd, "run_job", lambda spec: seen.append(spec))
    for seed in (1, 2):
        vs_trl_gkd.ours(tmp_path, 2, 8, 16, 5e-4, 2, None, "topk_forward", 8, seed)
    assert [spec.hyper_parameters.seed for spec in seen] == [1, 2]
    assert seen[0].validation_datasets == []


def test_trl_takes_the_batches_our_job_takes(tmp_path: Path) -> None:
    """The order TRL is handed is our job's `EpochCursor` for the seed, batch by batch, across epochs."""
    from opd_trainer.jobspec.dataset import EpochCursor

    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.jsonl").write_text("".join(f'{{"i": {i}}}\n' for i in range(10)))
    order = vs_trl_gkd.our_prompt_order(tmp_path, seed=3, steps=4, batch=4)  # 16 prompts: two epochs
    cursor = EpochCursor(10, 3)
    assert order == [i for _ in range(4) for i in cursor.next_batch(4)]
    assert sorted(order[:10]) == list(range(10)) and len(order) == 16
    assert order != vs_trl_gkd.our_prompt_order(tmp_path, seed=4, steps=4, batch=4)


def _run(curve: list[tuple[float, float]], samples_per_s: float = 1.0) -> dict[str, Any]:
    return {
        "curve": [{"step": i, "exact_match": em, "train_s": s} for i, (em, s) in enumerate(curve)],
        "samples_per_s": samples_per_s,
    }


def test_best_setting_is_fastest_to_target_then_best_reached() -> None:
    fast = _run([(0.2, 0), (0.7, 10.0)])
    slow = _run([(0.2, 0), (0.5, 5.0), (0.72, 20.0)])
    near = _run([(0.2, 0), (0.69, 4.0)])
    never = _run([(0.2, 0), (0.4, 4.0)], samples_per_s=100.0)
    runs = [slow, never, near, fast]
    assert min(runs, key=lambda r: vs_trl_gkd.rank(r, 0.7)) is fast
    assert min([never, near], key=lambda r: vs_trl_gkd.rank(r, 0.7)) is near
    assert vs_trl_gkd.seconds_to(slow["curve"], 0.7) == 20.0
    assert vs_trl_gkd.seconds_to(never["curve"], 0.7) is None


def test_sides_alternate() -> None:
    assert vs_trl_gkd.alternate([1, 2], ["a", "b", "c"]) == [1, "a", 2, "b", "c"]
    assert vs_trl_gkd.alternate([], ["a"]) == ["a"]


def test_child_arguments() -> None:
    args = vs_trl_gkd.argparse.Namespace(
        models_dir=Path("m"),
        steps=30,
        batch_size=8,
        max_new_tokens=64,
        eval_every=2,
        eval_samples=100,
        teacher_top_k=8,
    )
    argv = vs_trl_gkd.child_args(args, seed=1, beta=0.5, lr=1e-3, batch_size=32)
    assert argv[argv.index("--seed") + 1] == "1"
    assert argv[argv.index("--beta") + 1] == "0.5"
    assert argv[argv.index("--batch-size") + 1] == "32"
    assert argv.count("--batch-size") == 1


def test_repeat_reads_one_sided_results() -> None:
    step = {
        "parts_percent": {"other": 1.0, "teacher": 30.0, "rollout": 50.0},
        "step_s": 1.3,
        "samples_per_s": 20.0,
        "tokens_per_s": 500.0,
        "learner_fraction_of_matmul_limit": 0.1,
    }
    figures = repeat.figures_of("step_breakdown", [step, step, {"parts_percent": {}}])
    assert figures["other_percent"] == [1.0, 1.0, None]

    def seed(end: float, curve: list[tuple[int, float]]) -> dict[str, Any]:
        points = [{"step": s, "exact_match": em, "train_s": 10.0 * s} for s, em in curve]
        return {"start": 0.3, "end": end, "teacher": 0.95, "curve": points}

    efficacy = {
        "settings": {"steps": 40},
        "headline_opd_arm": "opd",
        "runs": {
            "opd": [seed(0.92, [(0, 0.3), (5, 0.7), (20, 0.9)]), seed(0.625, [(0, 0.3), (10, 0.7)])],
            "rl": [seed(0.3, [(0, 0.3)]), seed(0.7, [(0, 0.3), (20, 0.7)])],
        },
    }
    figures = repeat.figures_of("efficacy", [efficacy])
    assert figures["gap_closed"] == pytest.approx([0.62 / 0.65, 0.5])
    assert figures["steps_to_50_ratio"] == [40 / 5, 20 / 10]  # RL not reaching: the budget
    assert figures["train_s_to_90"] == [200.0, None]


def test_staleness_runs_pairs_interleaved_and_records_them(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import json

    import staleness

    order: list[tuple[str, int]] = []

    def fake_child(script: Path, side: str, args: list[str]) -> dict[str, Any]:
        seed = int(args[args.index("--seed") + 1])
        order.append((side, seed))
        return _staleness_run(side, seed)

    monkeypatch.setattr(staleness, "run_child", fake_child)
    argv = ["staleness.py", "--seeds", "0", "1", "2", "--out", str(tmp_path / "s.json")]
    monkeypatch.setattr(sys, "argv", [*argv, "--results-dir", str(tmp_path), "--publish"])
    monkeypatch.setattr(staleness, "write_record", _write_to(tmp_path))
    staleness.main()
    assert order == [("0", 0), ("1", 0), ("0", 1), ("1", 1), ("0", 2), ("1", 2)]
    record = json.loads((tmp_path / "published" / "staleness.json").read_text())
    assert record["figures"]["samples_per_s_ratio"]["values"] == [1.1, 1.2, 1.3]
    assert record["headline"] == {"samples_per_s_ratio_median": 1.2}
    assert record["figures"]["samples_per_s_ratio"]["publishable"]


def test_staleness_arms_run_in_order_per_seed_and_each_gets_its_figures(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import json

    import staleness

    calls: list[tuple[str, list[str]]] = []

    def fake_child(script: Path, side: str, args: list[str]) -> dict[str, Any]:
        calls.append((side, args))
        return _staleness_run(side, int(args[args.index("--seed") + 1]))

    monkeypatch.setattr(staleness, "run_child", fake_child)
    arms = ["--arms", "0", "2", "2:sampler", "--distill-loss", "sampled", "--record", "depth"]
    argv = ["staleness.py", "--seeds", "0", "1", "2", *arms, "--out", str(tmp_path / "d.json")]
    monkeypatch.setattr(sys, "argv", [*argv, "--results-dir", str(tmp_path), "--publish"])
    monkeypatch.setattr(staleness, "write_record", _write_to(tmp_path))
    staleness.main()
    assert [side for side, _ in calls] == ["0", "2", "2:sampler"] * 3
    assert all(args[args.index("--distill-loss") + 1] == "sampled" for _, args in calls)
    record = json.loads((tmp_path / "published" / "depth.json").read_text())
    assert record["headline"] == {}  # no arm 1: no overlap ratio to headline
    assert record["figures"]["samples_per_s/2:sampler"]["values"] == [12.0, 14.0, 16.0]
    assert set(record["figures"]) >= {
        "final_reverse_kl/0",
        "final_exact_match/2",
        "final_reverse_kl/2:sampler",
    }
    assert staleness.parse_arm("2:sampler") == (2, "sampler") and staleness.parse_arm("1") == (1, "current")


def _staleness_run(side: str, seed: int) -> dict[str, Any]:
    depth, _, divergence = side.partition(":")
    return {
        "arm": side,
        "max_staleness": int(depth),
        "stale_divergence": divergence or "current",
        "staleness_max": float(depth),
        "seed": seed,
        "steps_measured": 3,
        "step_s": 1.0,
        "samples_per_s": 10.0 + int(depth) * (1 + seed),
        "rollout_wait_s": 0.0,
        "teacher_wait_s": 0.0,
        "learner_s": 0.5,
        "staleness_mean": float(depth),
        "final_reverse_kl": 0.1,
        "train_s": 4.0,
        "curve": [],
        "final_exact_match": None,
    }


def _write_to(tmp_path: Path) -> Any:
    import records

    def write(record: Any, publish: bool, results_dir: Path, published_dir: Path) -> list[Path]:
        return records.write_record(record, publish, results_dir, tmp_path / "published")

    return write
