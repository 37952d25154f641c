"""Fingerprint of the learner's numbers, to show a change leaves them bit-identical.

Every estimator on the fixed batch of `tests/unit/test_learner_distillation.py` at two temperatures (its
loss and statistics as float hex, a hash of its gradient), and every metric of 3 real `Learner` steps
(DeepSpeed on CPU) on `tests/unit/test_preference_reference.py`'s segments in three configurations
(preference + beacon SFT, rolling reference, LoRA). Printed as JSON with sorted keys; run it on two
checkouts and compare the outputs byte for byte:

    (cd <before> && .venv/bin/python benchmarks/loss_fingerprint.py > /tmp/before.json)
    .venv/bin/python benchmarks/loss_fingerprint.py > /tmp/after.json && cmp /tmp/before.json /tmp/after.json

Run from a checkout's root: it imports that checkout's `opd_trainer` and test helpers.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path[:0] = ["tests/unit", "."]
os.environ.setdefault("DS_ACCELERATOR", "cpu")

import test_learner_distillation as distillation  # noqa: E402
import test_preference_reference as preference  # noqa: E402
import torch  # noqa: E402
from tiny_student import save_tiny_student  # noqa: E402

LEARNER_CONFIGS: dict[str, dict[str, Any]] = {
    "preference+sft": {"beacon_sft_coef": 0.5},
    "rolling": {"turn_preference_reference": "rolling", "turn_preference_reference_steps": 2},
    "lora": {"lora": {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}},
}


def estimator_fingerprints() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in distillation.ESTIMATORS:
        for temperature in (1.0, 0.7):
            loss, grad, stats, _ = distillation._loss_and_grad(name, temperature)
            out[f"{name}@{temperature}"] = [
                loss.item().hex(),
                hashlib.sha256(grad.numpy().tobytes()).hexdigest()[:16],
                {key: float(value).hex() for key, value in sorted(stats.items())},
            ]
    return out


def learner_fingerprints(steps: int = 3) -> dict[str, Any]:
    student = save_tiny_student(Path(tempfile.mkdtemp(prefix="opd-fingerprint-")))
    out: dict[str, Any] = {}
    for name, config in LEARNER_CONFIGS.items():
        torch.manual_seed(0)
        learner = preference._learner(student, **config)
        out[name] = [
            {
                key: float(value).hex()
                for key, value in sorted(learner.train_step([preference._segments()]).items())
                if not key.startswith("time") and not key.endswith("_s")  # wall times differ run to run
            }
            for _ in range(steps)
        ]
    return out


def main() -> None:
    torch.manual_seed(0)
    print(json.dumps({**estimator_fingerprints(), **learner_fingerprints()}, indent=0, sort_keys=True))


if __name__ == "__main__":
    main()
