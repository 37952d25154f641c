"""PNG curves of a run (reverse KL, reward, validation metrics, signal diagnostics) from metrics.jsonl, and
the final teacher / student-before / student-after table of its summary (`format_final_table`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

# Validation keys that are bookkeeping or already plotted elsewhere.
_NOT_VALIDATION_CURVES = frozenset({"kind", "step", "reverse_kl", "samples", "failed_samples"})
MAX_VALIDATION_CURVES = 4


def validation_curve_keys(evals: list[dict[str, Any]]) -> list[str]:
    """What the validation panel plots: the evaluator's score and metrics, else the mean reward.

    Taken from the records themselves (first reported first), since each job's evaluator names its own.
    """
    keys = [k for r in evals for k in r if k not in _NOT_VALIDATION_CURVES and not k.startswith("usage/")]
    keys = list(dict.fromkeys(keys))
    task = [k for k in keys if not k.startswith("reward")]
    return (task or [k for k in keys if k == "reward_mean"])[:MAX_VALIDATION_CURVES]


Series = list[tuple[str, list[dict[str, Any]], str]]


def signal_panels(train: list[dict[str, Any]]) -> list[tuple[str, Series]]:
    """Diagnostics of the distillation signal, for the steps that logged them (see docs/architecture.md).

    The teacher's mass on its own top-k and the student's mass on it share a [0, 1] panel; the spread of
    the per-token signal has its own scale.
    """
    panels: list[tuple[str, Series]] = []
    if any("teacher_topk_mass" in r for r in train):
        panels.append(
            (
                "mass on the teacher's top-k",
                [("teacher", train, "teacher_topk_mass"), ("student", train, "student_topk_mass")],
            )
        )
    if any("signal_std" in r for r in train):
        panels.append(("per-token signal std", [("train", train, "signal_std")]))
    return panels


def plot_curves(records: list[dict[str, Any]], out_path: Path, title: str = "") -> Path:
    # Lazy: matplotlib loads only when curves are drawn.
    import matplotlib

    matplotlib.use("Agg")  # no display on servers and CI
    import matplotlib.pyplot as plt

    train = [r for r in records if r["kind"] == "train"]
    evals = [r for r in records if r["kind"] == "eval"]
    panels: list[tuple[str, Series]] = [
        (
            "reverse KL per token",
            [("train (own samples)", train, "reverse_kl"), ("validation", evals, "reverse_kl")],
        ),
    ]
    curves = validation_curve_keys(evals)
    if curves:
        panels.append(("validation", [(key, evals, key) for key in curves]))
    if any("reward_mean" in r for r in train):
        panels.insert(1, ("task reward", [("mean", train, "reward_mean")]))
    panels += signal_panels(train)
    figure, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.6), squeeze=False)
    for axis, (name, series) in zip(axes[0], panels, strict=True):
        for label, rows, key in series:
            points = [(r["step"], r[key]) for r in rows if key in r]
            if points:
                axis.plot(*zip(*points, strict=True), marker="o" if rows is evals else None, label=label)
        axis.set_title(name)
        axis.set_xlabel("step")
        axis.grid(alpha=0.3)
        if axis.get_legend_handles_labels()[0]:
            axis.legend(fontsize=8)
    if title:
        figure.suptitle(title)
    figure.tight_layout()
    out_path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out_path, dpi=110)
    plt.close(figure)
    return out_path


# Per-validation bookkeeping, not a measurement: left out of the table.
_NOT_IN_TABLE = frozenset({"samples"})


def format_final_table(summary: dict[str, Any]) -> str:
    """Teacher / student before / student after, one column per metric the validations reported.

    The columns are whatever the job measured (the evaluator's metrics, rewards, reverse KL), in the
    order the first row reports them: the trainer knows no task's metric names.
    """
    rows = [
        (label, summary[key])
        for key, label in (
            ("teacher", "teacher"),
            ("student_before", "student before"),
            ("student_after", "student after"),
        )
        if summary.get(key)
    ]
    columns = list(dict.fromkeys(k for _, metrics in rows for k in metrics if k not in _NOT_IN_TABLE))
    widths = [max(9, len(c)) + 2 for c in columns]
    header = f"{'':<16}" + "".join(f"{c:>{w}}" for c, w in zip(columns, widths, strict=True))
    lines = [header, "-" * len(header)]
    for label, metrics in rows:
        cells = [
            f"{'—':>{w}}" if not isinstance(metrics.get(c), int | float) else f"{metrics[c]:>{w}.3f}"
            for c, w in zip(columns, widths, strict=True)
        ]
        lines.append(f"{label:<16}" + "".join(cells))
    return "\n".join(lines)
