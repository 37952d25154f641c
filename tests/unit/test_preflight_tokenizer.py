"""The same-tokenizer pre-flight: loaded once per folder state, and a changed tokenizer is seen."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from opd_trainer.errors import ConfigError
from opd_trainer.jobspec import preflight


def _tokenizer(folder: Path, words: list[str], template: str | None = None) -> str:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, **{word: i + 1 for i, word in enumerate(words)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]")
    if template is not None:
        fast.chat_template = template
    fast.save_pretrained(str(folder))
    return str(folder)


def test_same_tokenizer_passes_and_is_loaded_once(tmp_path: Path) -> None:
    student = _tokenizer(tmp_path / "student", ["hello", "world"])
    teacher = _tokenizer(tmp_path / "teacher", ["hello", "world"])
    preflight._identity.cache_clear()
    preflight.check_same_tokenizer(student, teacher)
    preflight.check_same_tokenizer(student, teacher)
    info = preflight._identity.cache_info()
    assert (info.misses, info.hits) == (2, 2)


def test_a_changed_teacher_tokenizer_is_seen(tmp_path: Path) -> None:
    student = _tokenizer(tmp_path / "student", ["hello", "world"])
    teacher = _tokenizer(tmp_path / "teacher", ["hello", "world"])
    preflight.check_same_tokenizer(student, teacher)
    _tokenizer(tmp_path / "teacher", ["hello", "world", "again"])
    with pytest.raises(ConfigError) as error:
        preflight.check_same_tokenizer(student, teacher)
    assert error.value.field == "teacher_model"
    assert "vocabularies of 4 and 3 tokens, 1 (token, id) pairs not shared" in str(error.value)


def test_a_changed_chat_template_is_seen_even_with_the_same_file_size(tmp_path: Path) -> None:
    student = _tokenizer(tmp_path / "student", ["hello"], template="{{ messages[0].content }}A")
    teacher = _tokenizer(tmp_path / "teacher", ["hello"], template="{{ messages[0].content }}A")
    preflight.check_same_tokenizer(student, teacher)
    config = Path(teacher) / "tokenizer_config.json"
    before = config.stat()
    config.write_text(config.read_text().replace("}}A", "}}B"))
    # Same size, and the same mtime a coarse filesystem clock could give: the mtime is bumped on purpose.
    os.utime(config, ns=(before.st_atime_ns, before.st_mtime_ns + 1_000_000))
    template_file = Path(teacher) / "chat_template.jinja"
    if template_file.exists():
        stat = template_file.stat()
        template_file.write_text(template_file.read_text().replace("}}A", "}}B"))
        os.utime(template_file, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    with pytest.raises(ConfigError, match="chat template differs") as error:
        preflight.check_same_tokenizer(student, teacher)
    assert error.value.field == "teacher_model"


def test_missing_folder_names_the_field(tmp_path: Path) -> None:
    student = _tokenizer(tmp_path / "student", ["hello"])
    with pytest.raises(ConfigError, match="cannot load the teacher's tokenizer") as error:
        preflight.check_same_tokenizer(student, str(tmp_path / "missing"))
    assert error.value.field == "teacher_model"


def test_each_of_several_teachers_is_checked_and_named(tmp_path: Path) -> None:
    student = _tokenizer(tmp_path / "student", ["hello", "world"])
    same = _tokenizer(tmp_path / "same", ["hello", "world"])
    other = _tokenizer(tmp_path / "other", ["hello", "there"])
    for path in (student, same, other):
        (Path(path) / "config.json").write_text('{"max_position_embeddings": 64}')
    sources = {"model": student, "teacher_model.0.model": same}
    assert preflight.preflight_models(None, sources) == 64
    with pytest.raises(ConfigError, match="tokenizer differs") as error:
        preflight.preflight_models(None, {**sources, "teacher_model.1.model": other})
    assert error.value.field == "teacher_model.1.model"
