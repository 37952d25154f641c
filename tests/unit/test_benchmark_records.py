"""The benchmarks' record format (benchmarks/records.py), the interleaved pairs' summaries
(benchmarks/interleave.py) and the published table (benchmarks/report.py): no benchmark is run."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import interleave  # noqa: E402
import records  # noqa: E402
import report  # noqa: E402


@pytest.fixture(scope="module")
def _environment() -> tuple[dict[str, object], dict[str, object]]:
    """The real versions and machine, looked up once (git and torch are slow to ask on a busy box)."""
    return records.versions(), records.machine()


@pytest.fixture(autouse=True)
def _cached_environment(
    monkeypatch: pytest.MonkeyPatch, _environment: tuple[dict[str, object], dict[str, object]]
) -> None:
    monkeypatch.setattr(records, "versions", lambda: dict(_environment[0]))
    monkeypatch.setattr(records, "machine", lambda: dict(_environment[1]))


def test_summary_of_three_runs_is_median_and_range() -> None:
    s = records.summarize([1.2, 0.9, 1.5])
    assert s["median"] == 1.2
    assert (s["min"], s["max"]) == (0.9, 1.5)
    assert s["runs"] == 3 and s["missing"] == 0
    assert s["publishable"]


def test_even_runs_median_is_the_mean_of_the_middle_two() -> None:
    assert records.summarize([1.0, 2.0, 4.0, 3.0])["median"] == 2.5


def test_fewer_than_three_runs_is_not_publishable() -> None:
    assert not records.summarize([1.7])["publishable"]
    assert not records.summarize([1.7, 1.1])["publishable"]
    # A missing value (a target never reached) is not a run.
    s = records.summarize([1.7, None, 1.1])
    assert s["runs"] == 2 and s["missing"] == 1 and not s["publishable"]
    assert s["values"] == [1.7, None, 1.1]
    empty = records.summarize([None])
    assert empty["median"] is None and empty["min"] is None and not empty["publishable"]


def test_a_pooled_figure_is_one_value_over_the_runs_it_pools() -> None:
    record = records.new_record(
        "unit_bench",
        {},
        seeds=[0, 1, 2],
        runs=[],
        figures={
            "diff": records.Pooled(0.06, runs=3),
            "few": records.Pooled(0.1, 2),
            "none": records.Pooled(None, 3),
        },
        headline=["diff"],
        argv=["benchmarks/unit_bench.py"],
    )
    diff = record.figures["diff"]
    assert (diff["median"], diff["min"], diff["max"], diff["runs"], diff["pooled"]) == (
        0.06,
        0.06,
        0.06,
        3,
        True,
    )
    assert diff["publishable"] and record.publishable and record.headline == {"diff_median": 0.06}
    assert not record.figures["few"]["publishable"]
    none = record.figures["none"]
    assert none["median"] is None and none["missing"] == 1 and not none["publishable"]


def _record(values: list[float | None]) -> records.Record:
    return records.new_record(
        "unit_bench",
        {"steps": 2, "models_dir": Path("/tmp/x")},
        seeds=[0, 1, 2],
        runs=[{"seed": i, "value": v} for i, v in enumerate(values)],
        figures={"speed_ratio": values, "other": [1.0, 2.0, 3.0]},
        headline=["speed_ratio"],
        argv=["benchmarks/unit_bench.py", "--steps", "2"],
    )


def test_record_round_trips_through_its_files(tmp_path: Path) -> None:
    record = _record([1.25, 1.5, 1.75])
    written = records.write_record(
        record, publish=True, results_dir=tmp_path / "results", published_dir=tmp_path / "published"
    )
    assert [p.name for p in written] == ["unit_bench.record.json", "unit_bench.json"]
    assert records.load_record(written[0]) == record
    published = records.load_published(tmp_path / "published")
    (copy,) = published
    # The published copy rounds floats to 6 significant digits; these figures need no rounding.
    for field in ("benchmark", "inputs", "versions", "seeds", "runs", "figures", "headline", "created"):
        assert getattr(copy, field) == getattr(record, field), field
    assert published[0].headline == {"speed_ratio_median": 1.5}
    assert published[0].publishable
    assert record.inputs["command"] == ".venv/bin/python benchmarks/unit_bench.py --steps 2"
    assert record.inputs["args"]["models_dir"] == "/tmp/x"
    for key in ("torch", "trl", "transformers", "deepspeed", "git"):
        assert key in record.versions
    for key in ("cpu", "cores", "memory_gib", "ATEN_CPU_CAPABILITY", "torch_cpu_capability"):
        assert key in record.machine


def test_published_copy_is_rounded(tmp_path: Path) -> None:
    record = _record([1 / 3, 0.5, 2 / 3])
    _, published = records.write_record(
        record, publish=True, results_dir=tmp_path, published_dir=tmp_path / "published"
    )
    data = json.loads(published.read_text())
    assert data["figures"]["speed_ratio"]["values"][0] == 0.333333


def test_headline_with_too_few_runs_makes_record_not_publishable() -> None:
    assert not _record([1.5, None, None]).publishable


def test_interleaved_pairs_run_in_order_and_summarise_ratios() -> None:
    order: list[str] = []

    def side(name: str, values: list[float]) -> object:
        def run(i: int) -> dict[str, float]:
            order.append(f"{name}{i}")
            return {"samples_per_s": values[i]}

        return run

    pairs = interleave.interleave(side("A", [10.0, 12.0, 9.0]), side("B", [5.0, 8.0, 6.0]), pairs=3)
    assert order == ["A0", "B0", "A1", "B1", "A2", "B2"]
    s = interleave.summarize_pairs(pairs, lambda r: r["samples_per_s"])
    assert s["a"]["median"] == 10.0 and s["b"]["median"] == 6.0
    assert s["ratio"]["values"] == [2.0, 1.5, 1.5]
    assert s["ratio"]["median"] == 1.5 and s["ratio"]["publishable"]
    inverse = interleave.summarize_pairs(pairs, lambda r: r["samples_per_s"], a_over_b=False)
    assert inverse["ratio"]["values"] == [0.5, 8.0 / 12.0, 6.0 / 9.0]


def test_one_target_table() -> None:
    target = records.target_for("vs_trl_gkd", "time_to_target_ratio")
    assert target is not None and str(target) == ">= 1.50x"
    assert target.met(1.6) and not target.met(1.2) and target.met(None) is None
    assert records.target_for("vs_trl_gkd", "samples_per_s_ratio") == records.Target(">=", 1.5)


def test_report_rows_and_markers(tmp_path: Path) -> None:
    published = tmp_path / "published"
    records.write_record(
        _record([1.2, 1.6, 1.7]), publish=True, results_dir=tmp_path, published_dir=published
    )
    docs, readme = tmp_path / "benchmarks.md", tmp_path / "README.md"
    docs.write_text("intro\n<!-- published:begin -->\nold\n<!-- published:end -->\nafter\n")
    readme.write_text("x\n<!-- published-headline:begin -->\n<!-- published-headline:end -->\ny\n")
    argv = ["--published", str(published), "--docs", str(docs), "--readme", str(readme)]
    assert report.main([*argv, "--check"]) == 1
    assert report.main([*argv, "--write"]) == 0
    assert report.main([*argv, "--check"]) == 0
    text = docs.read_text()
    assert text.startswith("intro\n") and text.endswith("after\n") and "old" not in text
    row = next(line for line in text.splitlines() if "speed_ratio" in line)
    assert "1.60x" in row and "1.20x–1.70x" in row and "| 3 |" in row
    assert "benchmarks/unit_bench.py --steps 2" in row
    assert "| speed_ratio |" in readme.read_text()


def test_report_without_records_says_nothing_is_published(tmp_path: Path) -> None:
    assert "No figure has yet been published" in report.headline_table([])
    assert "No figure has been published" in report.markdown_table([])


def test_not_publishable_row(tmp_path: Path) -> None:
    row = report.figure_row(_record([1.6, None, None]), "speed_ratio")
    assert row[4] == "1 (2 missing)"
    assert row[6].startswith("not publishable")


@pytest.mark.parametrize("values", [[2.0, 2.0, 2.0]])
def test_target_verdict_in_row(values: list[float]) -> None:
    record = _record(values)
    record.benchmark = "vs_trl_gkd"
    record.figures["time_to_target_ratio"] = records.summarize(values)
    row = report.figure_row(record, "time_to_target_ratio")
    assert row[5] == ">= 1.50x" and row[6] == "yes"


def test_refigure_recomputes_a_records_figures_from_its_own_runs(tmp_path: Path) -> None:
    """`repeat.py --refigure` adds a figure defined since to an earlier record, from that record's runs,
    and keeps what it measured (runs, machine, command)."""
    import repeat

    parts = [{"record": 0.003, "other": 0.02, "teacher": 0.1, "rollout": 0.5}, {"record": 0.005}]
    runs = [
        {"run": i, "result": {"parts_percent": {**parts[0], **parts[i % 2]}, "step_s": 1.0 + i}}
        for i in range(3)
    ]
    figures = {"step_s": [1.0, 2.0, 3.0]}
    old = records.new_record("step_breakdown", {"runs": 3}, seeds=[], runs=runs, figures=figures)
    old.machine = {"cores": 2, "cpu": "then"}
    path = tmp_path / "old.json"
    path.write_text(json.dumps(old.to_json()))
    repeat.main(
        ["step_breakdown", "--refigure", str(path), "--results-dir", str(tmp_path / "results"),
         "--published-dir", str(tmp_path / "published"), "--publish"]
    )  # fmt: skip
    (new,) = records.load_published(tmp_path / "published")
    assert new.figures["record_percent"]["values"] == [0.003, 0.005, 0.003]
    assert new.headline["record_percent_median"] == 0.003
    assert new.runs == old.runs and new.machine == old.machine and new.inputs == old.inputs
    dirs = f"--results-dir {tmp_path / 'results'} --published-dir {tmp_path / 'published'}"
    command = f"benchmarks/repeat.py step_breakdown --refigure {path} {dirs} --publish"
    assert new.notes[-1] == f"figures recomputed from these runs by: {command}"
    with pytest.raises(SystemExit, match="step_breakdown record, not api_load"):
        repeat.main(["api_load", "--refigure", str(path)])
