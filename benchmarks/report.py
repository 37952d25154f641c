"""The published table, built from the committed records in benchmarks/published/*.json only.

Each row is one figure of one record: median, range (min–max), runs, target (from `records.TARGETS`, the
one target table), whether the median meets it, and the command that regenerates the record (printed
beside the row, as the record wrote it). A figure from fewer than 3 runs shows "not publishable"
instead of a verdict. Nothing in the table is typed by hand.

`report.py` prints the table; `--write` also puts it into docs/benchmarks.md between
`<!-- published:begin -->` and `<!-- published:end -->`, and the headline figures into README.md between
`<!-- published-headline:begin -->` and `<!-- published-headline:end -->` (and `records.TARGETS` between
`<!-- targets:begin -->` and `<!-- targets:end -->` in the docs); `--check` exits 1 when
either file is not what `--write` would make (for CI). Run by `make bench` after the benchmarks.

`--results DIR` instead prints (never writes) the same table from a scratch folder: the records there
(`*.record.json`) and the one-run JSON of the one-sided benchmarks (read as `repeat.py` reads them, one
run each, so never publishable); `benchmarks/gpu_check.sh` ends with it.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from records import (
    MIN_RUNS,
    PUBLISHED_DIR,
    TARGETS,
    Record,
    format_value,
    load_published,
    load_results,
    new_record,
    target_for,
)

DOCS = Path("docs/benchmarks.md")
README = Path("README.md")
DOCS_MARKERS = ("<!-- published:begin -->", "<!-- published:end -->")
TARGETS_MARKERS = ("<!-- targets:begin -->", "<!-- targets:end -->")
README_MARKERS = ("<!-- published-headline:begin -->", "<!-- published-headline:end -->")
HEADER = ("record", "figure", "median", "range", "runs", "target", "met?", "regenerate")


def unit_of(benchmark: str, figure: str) -> str:
    target = target_for(benchmark, figure)
    if target is not None:
        return target.unit
    if "ratio" in figure:
        return "x"
    if figure.endswith("_percent"):
        return "%"
    return ""


def _number(value: float | None, unit: str) -> str:
    if value is None:
        return "—"
    if unit == "":
        return f"{value:.3g}"
    return format_value(value, unit)


def figure_row(record: Record, figure: str) -> tuple[str, ...]:
    summary: dict[str, Any] = record.figures[figure]
    unit = unit_of(record.benchmark, figure)
    target = target_for(record.benchmark, figure)
    runs = f"{summary['runs']}" + (f" ({summary['missing']} missing)" if summary["missing"] else "")
    spread = (
        "—" if summary["min"] is None else f"{_number(summary['min'], unit)}–{_number(summary['max'], unit)}"
    )
    if not summary["publishable"]:
        met = f"not publishable (< {MIN_RUNS} runs)"
    elif target is None:
        met = "—"
    else:
        met = "yes" if target.met(summary["median"]) else "**no**"
    return (
        record.benchmark,
        figure,
        _number(summary["median"], unit),
        spread,
        runs,
        str(target) if target else "—",
        met,
        f"`{record.inputs['command']}`",
    )


def rows(records: Sequence[Record]) -> list[tuple[str, ...]]:
    out = []
    for record in records:
        # Headline figures first, then the rest in the record's order.
        headline = [h.removesuffix("_median") for h in record.headline]
        for figure in [*headline, *(f for f in record.figures if f not in headline)]:
            out.append(figure_row(record, figure))
    return out


def markdown_table(records: Sequence[Record]) -> str:
    if not records:
        return (
            "No figure has been published yet under the rule above (a committed record in "
            "`benchmarks/published/`, at least 3 runs or pairs): `make bench` makes them."
        )
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in rows(records)]
    made = ", ".join(
        f"`{r.benchmark}` {r.created[:10]} at {str(r.versions['git']['commit'])[:10]}"
        + (" (uncommitted changes)" if r.versions["git"].get("dirty") else "")
        for r in records
    )
    lines += ["", f"Records: {made}."]
    return "\n".join(lines)


def headline_table(records: Sequence[Record]) -> str:
    """README's few numbers: every record's headline figures (median, range, runs, target, met?)."""
    picked = [(r, h.removesuffix("_median")) for r in records for h in r.headline]
    if not picked:
        return (
            "No figure has yet been published under the rule of "
            "[`docs/benchmarks.md`](docs/benchmarks.md#published-figures) (every figure the median of at "
            "least 3 runs or interleaved pairs, from a committed record that `make bench` regenerates). "
            "Earlier single, unrepeated runs are kept there under their dates as history."
        )
    lines = ["| record | figure | median | range | runs | target | met? |", "|---|---|---|---|---|---|---|"]
    for record, figure in picked:
        row = figure_row(record, figure)
        lines.append("| " + " | ".join(row[:7]) + " |")
    return "\n".join(lines)


def targets_table() -> str:
    lines = ["| record | figure | target |", "|---|---|---|"]
    lines += [f"| `{b}` | `{f}` | {t} |" for (b, f), t in TARGETS.items()]
    return "\n".join(lines)


def replace_between(text: str, markers: tuple[str, str], body: str) -> str:
    begin, end = markers
    if begin not in text or end not in text:
        raise SystemExit(f"markers {begin} … {end} not found")
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    return f"{head}{begin}\n{body}\n{end}{tail}"


def plain_table(records: Sequence[Record]) -> str:
    table = [HEADER, *rows(records)]
    widths = [max(len(row[i]) for row in table) for i in range(len(HEADER))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in table)


def scratch_records(results_dir: Path) -> list[Record]:
    """The records in `results_dir`, and a one-run record from each one-sided benchmark's plain JSON."""
    import json

    from repeat import FIGURES, HEADLINE, figures_of

    records = load_results(results_dir)
    have = {r.benchmark for r in records}
    for name in sorted(set(FIGURES) - have):
        path = results_dir / f"{name}.json"
        if path.exists():
            result = json.loads(path.read_text())
            figures = figures_of(name, [result])
            records.append(
                new_record(name, {"out": str(path)}, [], [], figures, HEADLINE[name], argv=[str(path)])
            )
    return records


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--published", type=Path, default=PUBLISHED_DIR)
    parser.add_argument("--docs", type=Path, default=DOCS)
    parser.add_argument("--readme", type=Path, default=README)
    parser.add_argument("--results", type=Path, default=None, help="print a scratch folder's table instead")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help="write the tables into the docs and README")
    mode.add_argument("--check", action="store_true", help="exit 1 if the docs or README are out of date")
    args = parser.parse_args(argv)
    if args.results is not None:
        print(plain_table(scratch_records(args.results)))
        return 0
    records = load_published(args.published)
    print(plain_table(records) if records else markdown_table(records))
    if not (args.write or args.check):
        return 0
    stale = []
    for path, blocks in (
        (args.docs, [(DOCS_MARKERS, markdown_table(records)), (TARGETS_MARKERS, targets_table())]),
        (args.readme, [(README_MARKERS, headline_table(records))]),
    ):
        text = new = path.read_text()
        for markers, body in blocks:
            if markers[0] in new or markers is not TARGETS_MARKERS:
                new = replace_between(new, markers, body)
        if new != text:
            stale.append(path)
            if args.write:
                path.write_text(new)
                print(f"wrote {path}")
    if args.check and stale:
        print(
            f"out of date: {', '.join(map(str, stale))} (run benchmarks/report.py --write)", file=sys.stderr
        )
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
