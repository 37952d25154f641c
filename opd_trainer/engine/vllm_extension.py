"""vLLM worker extension that reloads model weights in place from a shared-memory safetensors file.

The worker half of the shm / ray weight transfers (`engine/weight_transfer.py`, which calls it).
Loaded by name into every vLLM worker (`worker_extension_cls`) and called through
`collective_rpc`, because vLLM's RPC serializer refuses plain functions and
`model.load_weights` fails once the engine has started ("Parameter has no attribute
weight_loader"); `model_runner.reload_weights` is the supported in-place path.
"""

from __future__ import annotations

import traceback
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

EXTENSION_CLASSPATH = "opd_trainer.engine.vllm_extension.WeightReloadExtension"
# The method `collective_rpc` calls on every worker (`WeightReloadExtension.opd_reload_weights_from_file`).
RELOAD_FROM_FILE = "opd_reload_weights_from_file"


class WeightReloadExtension:
    """Mixed into vLLM's worker class; `self.model_runner` is the worker's model runner."""

    model_runner: object

    def opd_reload_weights_from_file(self, path: str) -> dict[str, object]:
        """Returns {"ok", "num_tensors", "error"} instead of raising.

        An exception escaping a collective RPC takes the whole engine core down with it; a failed
        update should fail the update, not the engine. Names and shapes are checked against the
        checkpoint the engine started from before anything is loaded: a half-applied reload would
        leave the model broken for every later update.
        """
        try:
            problem = self._check_against_checkpoint(path)
            if problem:
                return {"ok": False, "num_tensors": 0, "error": problem}
            num_tensors = self._reload_from_file(path)
            self._retie_output_embeddings()
        except Exception:
            return {"ok": False, "num_tensors": 0, "error": traceback.format_exc(limit=8)}
        return {"ok": True, "num_tensors": num_tensors, "error": ""}

    def _checkpoint_shapes(self) -> dict[str, tuple[int, ...]]:
        cached: dict[str, tuple[int, ...]] | None = getattr(self, "_opd_checkpoint_shapes", None)
        if cached is None:
            cached = {}
            model_dir = Path(self.model_runner.model_config.model)  # type: ignore[attr-defined]
            for file in sorted(model_dir.glob("*.safetensors")):
                with safe_open(str(file), framework="pt", device="cpu") as handle:
                    for name in handle.keys():  # noqa: SIM118 (safe_open has no __iter__)
                        cached[name] = tuple(handle.get_slice(name).get_shape())
            self._opd_checkpoint_shapes = cached
        return cached

    def _check_against_checkpoint(self, path: str) -> str:
        """Why the file cannot replace the engine's weights ('' if it can)."""
        expected = self._checkpoint_shapes()
        if not expected:
            return ""  # not a safetensors checkpoint on disk: nothing to compare with
        with safe_open(path, framework="pt", device="cpu") as handle:
            got = {name: tuple(handle.get_slice(name).get_shape()) for name in handle.keys()}  # noqa: SIM118
        unknown = sorted(set(got) - set(expected) - {"lm_head.weight"})
        if unknown:
            return f"weights not in the served model: {unknown[:5]}"
        wrong = [
            f"{n}: {got[n]} != {expected[n]}" for n in sorted(got) if n in expected and got[n] != expected[n]
        ]
        if wrong:
            return f"shape mismatch with the served model: {wrong[:5]}"
        return ""

    def _reload_from_file(self, path: str) -> int:
        with safe_open(path, framework="pt", device="cpu") as handle:
            names = list(handle.keys())

            def weights() -> Iterator[tuple[str, torch.Tensor]]:
                # Lazily, one tensor at a time, so peak memory stays one tensor above the model.
                for name in names:
                    yield name, handle.get_tensor(name)

            self.model_runner.reload_weights(weights_iterator=weights())  # type: ignore[attr-defined]
        return len(names)

    def _retie_output_embeddings(self) -> None:
        """Makes a tied LM head use the new input embeddings.

        Tied checkpoints carry no `lm_head.weight`, so vLLM's layerwise reload sees the head as
        "failed to load" and restores its old state: without this the logits use the old weights.
        """
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        hf_config = self.model_runner.model_config.hf_config  # type: ignore[attr-defined]
        lm_head = getattr(model, "lm_head", None)
        embed = getattr(getattr(model, "model", None), "embed_tokens", None)
        if not getattr(hf_config, "tie_word_embeddings", False) or lm_head is None or embed is None:
            return
        if lm_head.weight.data_ptr() != embed.weight.data_ptr():
            with torch.no_grad():
                lm_head.weight.copy_(embed.weight)
        # On CPU the head's GEMM holds a pre-packed copy of the weight (built once after loading);
        # rebuild it or logits keep coming from the old embeddings.
        quant_method = getattr(lm_head, "quant_method", None)
        if quant_method is not None:
            quant_method.process_weights_after_loading(lm_head)
