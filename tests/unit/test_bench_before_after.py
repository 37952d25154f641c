"""benchmarks/before_after.py's pure parts (no benchmark run): each pair's figures and ratios, the
environment a side runs in, and the arguments it refuses."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import before_after  # noqa: E402


def _step_breakdown(learner_s: float, step_s: float) -> dict[str, Any]:
    parts = {"rollout": 0.5, "teacher": 0.1, "record": 0.0, "learner": learner_s, "other": 0.01}
    return {
        "parts_s": parts,
        "parts_percent": {name: 100 * seconds / step_s for name, seconds in parts.items()},
        "step_s": step_s,
        "samples_per_s": 32 / step_s,
        "tokens_per_s": 400.0,
        "learner_fraction_of_matmul_limit": 0.1,
    }


def test_each_pair_gives_both_sides_values_and_its_after_over_before_ratio() -> None:
    before = [_step_breakdown(0.6, 2.0), _step_breakdown(0.8, 2.0)]
    after = [_step_breakdown(0.45, 1.5), _step_breakdown(0.4, 1.6)]
    figures = before_after.pair_figures("step_breakdown", before, after)
    assert figures["learner_s/before"] == [0.6, 0.8]
    assert figures["learner_s/after"] == [0.45, 0.4]
    assert figures["learner_s/ratio"] == pytest.approx([0.75, 0.5])
    assert figures["step_s/ratio"] == pytest.approx([0.75, 0.8])
    assert {name.rsplit("/", 1)[1] for name in figures} == {"before", "after", "ratio"}
    chosen = before_after.pair_figures("step_breakdown", before, after, ["learner_s"])
    assert list(chosen) == ["learner_s/before", "learner_s/after", "learner_s/ratio"]


def test_a_figure_a_run_lacks_has_no_ratio_for_that_pair() -> None:
    broken = _step_breakdown(0.6, 2.0)
    del broken["parts_s"]
    figures = before_after.pair_figures("step_breakdown", [broken], [_step_breakdown(0.5, 2.0)])
    assert figures["learner_s/before"] == [None]
    assert figures["learner_s/ratio"] == [None]


def test_a_side_imports_its_own_folder_first_and_reads_this_checkouts_models(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    env = before_after.side_env(tmp_path)
    assert env["PYTHONPATH"].split(os.pathsep) == [str(tmp_path), "/elsewhere"]
    assert env["OPD_TINY_MODELS_DIR"] == str((ROOT / ".cache" / "tiny-models").resolve())


def test_unknown_headline_figures_and_revisions_are_refused_before_anything_runs() -> None:
    with pytest.raises(SystemExit, match=r"--headline: \['learner_s/speedup'\] are not figures"):
        before_after.main(["step_breakdown", "--before", "HEAD", "--headline", "learner_s/speedup"])
    with pytest.raises(SystemExit, match=r"--headline: \['step_s/ratio'\] are not figures recorded"):
        before_after.main(
            ["step_breakdown", "--before", "HEAD", "--figures", "learner_s", "--headline", "step_s/ratio"]
        )
    with pytest.raises(SystemExit, match=r"--figures: \['learner_seconds'\] are not figures of"):
        before_after.main(["step_breakdown", "--before", "HEAD", "--figures", "learner_seconds"])
    with pytest.raises(SystemExit, match="--before: 'no-such-revision' names no commit"):
        before_after.main(["step_breakdown", "--before", "no-such-revision"])
