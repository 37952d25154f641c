"""A tiny random Qwen2 student (vocabulary 64, 2 layers, tied embeddings) with a ChatML tokenizer, saved
to a folder: what the learner's unit tests train on one DeepSpeed rank."""

from __future__ import annotations

from pathlib import Path

import torch
from chatml_tokenizer import save_chatml_tokenizer

VOCAB = 64


def save_tiny_student(folder: Path) -> str:
    """Builds the student (seed 0) into `folder` and returns its path."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=128,
        tie_word_embeddings=True,
    )
    Qwen2ForCausalLM(config).save_pretrained(folder)
    save_chatml_tokenizer(folder)
    return str(folder)
