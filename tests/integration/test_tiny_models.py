"""The built tiny teacher/student: manifest metrics, checkpoint layout, loading and greedy decoding."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer

from opd_trainer.demo.tiny_models import TinyModels, build_tiny_models, render_chat
from opd_trainer.demo.tiny_models.training import generate_replies
from opd_trainer.demo.tool_routing import evaluator
from opd_trainer.jsonl import read_jsonl

pytestmark = pytest.mark.integration

ROLES = ("teacher", "student")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def test_manifest_metrics(tiny_models: TinyModels) -> None:
    teacher = tiny_models.manifest["teacher"]["validation"]
    student = tiny_models.manifest["student"]["validation"]
    assert teacher["n"] == student["n"] == 200
    assert teacher["exact_match"] >= 0.95
    assert student["exact_match"] <= 0.5 * teacher["exact_match"]
    # Weak but not broken, so that on-policy distillation has something to climb from.
    assert student["exact_match"] >= 0.1
    assert student["format_validity"] >= 0.7


def test_checkpoint_layout(tiny_models: TinyModels) -> None:
    max_length = tiny_models.manifest["data"]["max_length"]
    configs = []
    for role in ROLES:
        directory: Path = getattr(tiny_models, role)
        config = json.loads((directory / "config.json").read_text())
        assert config["architectures"] == ["Qwen2ForCausalLM"]
        assert config["head_dim"] >= 32
        assert config["head_dim"] * config["num_attention_heads"] == config["hidden_size"]
        assert config["tie_word_embeddings"] is True
        assert config["dtype"] == "float32"
        assert config["max_position_embeddings"] >= max_length + 64
        generation = json.loads((directory / "generation_config.json").read_text())
        assert generation["eos_token_id"] == [config["eos_token_id"], config["pad_token_id"]]
        assert (directory / "model.safetensors").is_file()
        configs.append(config)
    # Same architecture, so that teacher weights can be synced into a student engine.
    assert configs[0] == configs[1]
    for name in TOKENIZER_FILES:
        assert (tiny_models.teacher / name).read_bytes() == (tiny_models.student / name).read_bytes()
    for split, n in (("train", 4000), ("validation", 200)):
        assert len(read_jsonl(tiny_models.data_dir / f"{split}.jsonl")) == n


def test_saved_tokenizer_renders_and_encodes_like_the_build(tiny_models: TinyModels) -> None:
    """AutoTokenizer (what vLLM loads) applies the packaged template and the trained BPE unchanged."""
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_models.student))
    raw = Tokenizer.from_file(str(tiny_models.student / "tokenizer.json"))
    assert (tokenizer.eos_token, tokenizer.pad_token, tokenizer.bos_token) == (
        "<|im_end|>",
        "<|endoftext|>",
        None,
    )
    vocab = tokenizer.get_vocab()
    for marker in ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"):
        assert tokenizer.encode(marker, add_special_tokens=False) == [vocab[marker]]
    # Not special: hermes parsing sees them even when special tokens are skipped.
    call = tokenizer.encode("<tool_call>\n{}\n</tool_call><|im_end|>", add_special_tokens=False)
    assert tokenizer.decode(call, skip_special_tokens=True) == "<tool_call>\n{}\n</tool_call>"
    for record in read_jsonl(tiny_models.data_dir / "validation.jsonl")[:50]:
        expected = render_chat(record["messages"], record["tools"], add_generation_prompt=True)
        rendered = tokenizer.apply_chat_template(
            record["messages"], tools=record["tools"], add_generation_prompt=True, tokenize=False
        )
        assert rendered == expected
        assert tokenizer(rendered, add_special_tokens=False)["input_ids"] == raw.encode(rendered).ids


@pytest.mark.parametrize("role", ROLES)
def test_hf_greedy_decoding_reproduces_the_manifest(tiny_models: TinyModels, role: str) -> None:
    """The saved checkpoint, loaded with plain HF (left padding, whole prompts), scores what the build
    measured on the in-memory model with prefix-cached decoding, over the whole validation set.

    Same weights and both greedy, so only near-tie argmax flips between the two attention layouts can
    differ; the margins allow a few of those and nothing more. The build's own numbers are the
    reference, so a build on another CPU (other weights, other scores) is held to its own manifest.
    """
    records = read_jsonl(tiny_models.data_dir / "validation.jsonl")
    directory = getattr(tiny_models, role)
    model = AutoModelForCausalLM.from_pretrained(str(directory))
    tokenizer = AutoTokenizer.from_pretrained(str(directory), padding_side="left")
    prompts = [
        tokenizer.apply_chat_template(
            r["messages"], tools=r["tools"], add_generation_prompt=True, tokenize=False
        )
        for r in records
    ]
    texts: list[str] = []
    for lo in range(0, len(prompts), 40):
        batch = tokenizer(prompts[lo : lo + 40], return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            out = model.generate(**batch, max_new_tokens=64, do_sample=False)
        texts += tokenizer.batch_decode(out[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)
    metrics = evaluator.evaluate_texts(texts, records)
    built = tiny_models.manifest[role]["validation"]
    for key in ("exact_match", "format_validity", "decision_accuracy"):
        assert metrics[key] == pytest.approx(built[key], abs=0.03), key

    ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    shared = next(i for i in range(min(map(len, ids))) if len({row[i] for row in ids}) > 1)
    eos_ids = list(model.generation_config.eos_token_id)
    cached = generate_replies(
        model, ids[0][:shared], [r[shared:] for r in ids], eos_ids, tokenizer.pad_token_id
    )
    cached_texts = tokenizer.batch_decode(cached, skip_special_tokens=True)
    agree = sum(a == b for a, b in zip(cached_texts, texts, strict=True)) / len(texts)
    assert agree >= 0.95, f"prefix-cached and whole-prompt greedy replies agree on only {agree:.1%}"


def test_manifest_records_how_it_was_built(tiny_models: TinyModels) -> None:
    build = tiny_models.manifest["build"]
    assert build["threads"] >= 1 and build["machine"] and build["cpu"] and build["cpu_kernels"]
    assert tiny_models.manifest["teacher"]["target_exact_match"] == 0.95


def test_second_build_is_a_cache_hit(tiny_models: TinyModels) -> None:
    """Nothing is rebuilt or rewritten (checked on the files, not on a wall-clock budget)."""
    files = [tiny_models.teacher / "model.safetensors", tiny_models.teacher.parent / "manifest.json"]
    before = [f.stat().st_mtime_ns for f in files]
    again = build_tiny_models(tiny_models.teacher.parent, seed=tiny_models.manifest["seed"])
    assert again == tiny_models
    assert [f.stat().st_mtime_ns for f in files] == before
