"""vLLM worker extension: the worker half of every weight transport, reloading weights in place.

Loaded by name into every vLLM worker (`worker_extension_cls`, `EXTENSION_CLASSPATH`) and called
through `collective_rpc`, because vLLM's RPC serializer refuses plain functions (so arguments are plain
values: paths, lists, bytes) and `model.load_weights` alone fails once the engine has started
("Parameter has no attribute weight_loader").

- shm / ray (`transports.py`): `opd_reload_weights_from_file` memory-maps a safetensors file and
  reloads from it with `model_runner.reload_weights(weights_iterator=...)`, vLLM's in-place path.
- cuda_ipc / nccl (`streamed.py`, not yet run on a GPU): the same reload split in three so that it
  can take buckets one RPC at a time: `opd_begin_reload` (vLLM's `initialize_layerwise_reload`, as
  `reload_weights` starts), one `opd_load_ipc_bucket` / `opd_load_nccl_bucket` per bucket
  (`model.load_weights` on the bucket's views), `opd_finish_reload` (`finalize_layerwise_reload`,
  then the caches `reload_weights` resets). Names and shapes are checked first (`opd_check_specs`);
  a failure in the middle of a stream still finalizes, so some layers may then hold new weights.
"""

from __future__ import annotations

import contextlib
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from opd_trainer.weight_sync.buckets import BucketEntry, unpack_bucket
from opd_trainer.weight_sync.gpu import open_cuda_buffer, pynccl_comm

EXTENSION_CLASSPATH = "opd_trainer.weight_sync.worker_extension.WeightReloadExtension"
# The methods `collective_rpc` calls on every worker (`WeightReloadExtension.<name>`).
RELOAD_FROM_FILE = "opd_reload_weights_from_file"
CHECK_SPECS = "opd_check_specs"
BEGIN_RELOAD = "opd_begin_reload"
IPC_LOAD_BUCKET = "opd_load_ipc_bucket"
NCCL_JOIN = "opd_nccl_join"
NCCL_LOAD_BUCKET = "opd_load_nccl_bucket"
FINISH_RELOAD = "opd_finish_reload"


def entries_from_wire(entries: list[list[Any]]) -> list[BucketEntry]:
    """`BucketMessage.to_wire`'s entries back as `BucketEntry`s."""
    return [
        BucketEntry(name, dtype, tuple(shape), offset, nbytes)
        for name, dtype, shape, offset, nbytes in entries
    ]


def _answer(work: Callable[[], int]) -> dict[str, object]:
    """{"ok", "num_tensors", "error"} instead of an exception, which would take the engine core down."""
    try:
        num_tensors = work()
    except Exception:
        return {"ok": False, "num_tensors": 0, "error": traceback.format_exc(limit=8)}
    return {"ok": True, "num_tensors": num_tensors, "error": ""}


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
        with safe_open(path, framework="pt", device="cpu") as handle:
            got = {name: tuple(handle.get_slice(name).get_shape()) for name in handle.keys()}  # noqa: SIM118
        return self._check_shapes(got)

    def _check_shapes(self, got: dict[str, tuple[int, ...]]) -> str:
        """Why weights of these names and shapes cannot replace the engine's ('' if they can)."""
        expected = self._checkpoint_shapes()
        if not expected:
            return ""  # not a safetensors checkpoint on disk: nothing to compare with
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

    # -- streamed transports (cuda_ipc, nccl): one RPC per bucket between a begin and a finish -------

    def opd_check_specs(self, specs: list[list[Any]]) -> dict[str, object]:
        """Checks [name, dtype, shape] of every tensor to come against the served checkpoint."""

        def check() -> int:
            problem = self._check_shapes({name: tuple(shape) for name, _, shape in specs})
            if problem:
                raise ValueError(problem)
            return len(specs)

        return _answer(check)

    def opd_begin_reload(self) -> dict[str, object]:
        def begin() -> int:
            with self._opd_vllm_config():
                self._opd_layerwise_begin()
            self._opd_reloading = True
            return 0

        return _answer(begin)

    def opd_load_ipc_bucket(self, message: dict[str, Any]) -> dict[str, object]:
        """Opens the learner's buffer by its IPC handle and loads the bucket's views from it."""

        def load() -> int:
            flat = self._opd_open_ipc(message["handle"])
            count = self._opd_load_views(flat, message)
            del flat  # the learner may overwrite its buffer once every replica has answered
            return count

        return _answer(load)

    def opd_nccl_join(self, host: str, port: int, first_rank: int, world_size: int) -> dict[str, object]:
        """Joins the learner's broadcast group as rank `first_rank` + this worker's rank."""

        def join() -> int:
            rank = first_rank + int(getattr(self, "rank", 0))
            self._opd_comm = self._opd_nccl_comm(host, port, rank, world_size, self._opd_device())
            return 0

        return _answer(join)

    def opd_load_nccl_bucket(self, message: dict[str, Any]) -> dict[str, object]:
        """Receives the bucket the learner broadcasts into a buffer of this worker's and loads it."""

        def load() -> int:
            flat = torch.empty(message["size"], dtype=torch.uint8, device=self._opd_device())
            self._opd_comm.broadcast(flat, 0)
            return self._opd_load_views(flat, message)

        return _answer(load)

    def opd_finish_reload(self, ok: bool) -> dict[str, object]:
        """Ends a streamed reload (whatever happened: vLLM's layerwise state must not linger), re-ties
        the output embeddings when `ok`, and leaves the nccl group."""

        def finish() -> int:
            self._opd_comm = None
            if not getattr(self, "_opd_reloading", False):
                return 0
            self._opd_reloading = False
            with self._opd_vllm_config():
                self._opd_layerwise_end()
            if ok:
                self._retie_output_embeddings()
            return 0

        return _answer(finish)

    def _opd_load_views(self, flat: torch.Tensor, message: dict[str, Any]) -> int:
        weights = unpack_bucket(flat, entries_from_wire(message["entries"]))
        with self._opd_vllm_config():
            self.model_runner.get_model().load_weights(weights)  # type: ignore[attr-defined]
        if flat.is_cuda:
            torch.cuda.synchronize(flat.device)  # copied out before the answer frees the buffer
        return len(weights)

    def _opd_vllm_config(self) -> contextlib.AbstractContextManager[object]:
        config = getattr(self, "vllm_config", None)
        if config is None:
            return contextlib.nullcontext()
        from vllm.config import set_current_vllm_config

        return set_current_vllm_config(config)

    def _opd_device(self) -> torch.device:
        device = getattr(self, "device", None)
        if isinstance(device, torch.device):
            return device
        return torch.device("cuda", torch.cuda.current_device())

    def _opd_open_ipc(self, handle: bytes) -> torch.Tensor:
        return open_cuda_buffer(handle)

    def _opd_nccl_comm(self, host: str, port: int, rank: int, world_size: int, device: torch.device) -> Any:
        return pynccl_comm(host, port, rank, world_size, device)

    def _opd_layerwise_begin(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model_runner.get_model())  # type: ignore[attr-defined]

    def _opd_layerwise_end(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        runner: Any = self.model_runner
        finalize_layerwise_reload(runner.get_model(), runner.model_config)
        for reset in ("reset_lora_state", "reset_encoder_cache", "reset_mm_cache"):
            if hasattr(runner, reset):
                getattr(runner, reset)()
