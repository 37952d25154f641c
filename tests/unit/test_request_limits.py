"""The job server's limits without a server: per-key token buckets, event-stream slots, the bounded
dataset validator (a real child process), the model-folder guard, quota settings, and that nothing
in the project lets transformers run a model's own code."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from pydantic import ValidationError

from api.errors import APIError
from api.limits import MAX_BUCKETS, StreamSlots, TokenBuckets
from api.services import datasets, model_files
from api.settings import Settings
from opd_trainer.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]
MIB = 1024 * 1024


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_bucket_allows_its_burst_then_the_rate() -> None:
    clock = Clock()
    buckets = TokenBuckets(per_s=2.0, burst=3, clock=clock)
    assert [buckets.take("a") for _ in range(3)] == [0.0, 0.0, 0.0]
    assert buckets.take("a") == pytest.approx(0.5)  # one token comes back every 0.5 s
    assert buckets.take("b") == 0.0  # another key has its own bucket
    clock.now += 0.5
    assert buckets.take("a") == 0.0
    assert buckets.take("a") > 0
    clock.now += 60  # refills up to the burst, no further
    assert [buckets.take("a") for _ in range(4)][-1] > 0


def test_buckets_are_bounded_in_number() -> None:
    buckets = TokenBuckets(per_s=1.0, burst=1, clock=Clock())
    for i in range(MAX_BUCKETS + 10):
        buckets.take(f"k{i}")
    assert len(buckets._buckets) == MAX_BUCKETS


def test_stream_slots_are_per_tenant_and_released_once() -> None:
    slots = StreamSlots(per_tenant=2)
    first, _second = slots.acquire("t1"), slots.acquire("t1")
    with pytest.raises(APIError) as refused:
        slots.acquire("t1")
    assert refused.value.status == 429 and "OPD_EVENT_STREAMS_PER_TENANT" in refused.value.message
    slots.acquire("t2")  # another tenant is not affected
    first()
    first()  # a second release of the same slot frees nothing more
    slots.acquire("t1")
    with pytest.raises(APIError):
        slots.acquire("t1")


def validate(path: Path, **bounds: float) -> int:
    given = {"max_line_bytes": MIB, "max_records": 1000, "timeout_s": 30.0, "max_memory_bytes": 1024 * MIB}
    return datasets.validate(path, **{**given, **bounds})  # type: ignore[arg-type]


def write(tmp_path: Path, text: str | bytes) -> Path:
    path = tmp_path / "data.jsonl"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return path


RECORD = json.dumps({"messages": [{"role": "user", "content": "hi"}]})


def test_the_child_counts_records_like_parse_jsonl(tmp_path: Path) -> None:
    assert validate(write(tmp_path, f"{RECORD}\n\n{RECORD}\n")) == 2
    with pytest.raises(ConfigError) as bad:
        validate(write(tmp_path, f'{RECORD}\n{{"messages": []}}\n'))
    assert bad.value.field == "file" and "line 2: messages" in bad.value.message


@pytest.mark.parametrize(
    ("text", "bounds", "message"),
    [
        (
            f"{RECORD}\n" + json.dumps({"task": "x" * 5000}) + "\n",
            {"max_line_bytes": 4096},
            "line 2 is longer",
        ),
        (f"{RECORD}\n" * 11, {"max_records": 10}, "more than 10 records"),
        ("[" * 200_000 + "\n", {}, "nested too deeply"),
        (b"\xff\xfe\n", {}, "not UTF-8"),
        ("\n\n", {}, "no records"),
    ],
)
def test_the_child_refuses_what_breaks_a_bound(
    tmp_path: Path, text: str | bytes, bounds: dict[str, float], message: str
) -> None:
    with pytest.raises(ConfigError) as refused:
        validate(write(tmp_path, text), **bounds)
    assert message in refused.value.message and refused.value.field == "file"


def test_the_child_is_bounded_in_time_and_memory(tmp_path: Path) -> None:
    path = write(tmp_path, f"{RECORD}\n" * 200_000)  # 10 MB: some 100 MB of parsed records
    with pytest.raises(ConfigError, match="OPD_DATASET_VALIDATE_TIMEOUT_S"):
        validate(path, timeout_s=0.001)
    with pytest.raises(ConfigError, match="OPD_DATASET_VALIDATE_MAX_MEMORY_BYTES"):
        validate(path, max_records=200_000, max_memory_bytes=64 * MIB)
    assert validate(path, max_records=200_000, max_memory_bytes=1024 * MIB) == 200_000


def model_folder(tmp_path: Path, **tokenizer_config: object) -> Path:
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"max_position_embeddings": 128}))
    (folder / "tokenizer.json").write_text(json.dumps({"model": {"vocab": {"a": 0}}}))
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    (folder / "model.safetensors").write_bytes(b"\0" * 8192)  # weights are not pre-flight's to read
    return folder


def test_a_plain_model_folder_passes(tmp_path: Path) -> None:
    model_files.check_model_folder(
        model_folder(tmp_path, tokenizer_class="PreTrainedTokenizerFast"), "model", 4096
    )


def test_a_model_folder_that_names_custom_code_is_refused(tmp_path: Path) -> None:
    folder = model_folder(tmp_path, auto_map={"AutoTokenizer": [None, "tokenization_x.XTokenizer"]})
    with pytest.raises(ConfigError) as refused:
        model_files.check_model_folder(folder, "teacher_model", 1 * MIB)
    assert refused.value.field == "teacher_model" and "custom code" in refused.value.message
    assert str(tmp_path) not in refused.value.message


def test_model_config_and_tokenizer_files_are_bounded(tmp_path: Path) -> None:
    folder = model_folder(tmp_path)
    (folder / "vocab.txt").write_bytes(b"w\n" * 4096)
    with pytest.raises(ConfigError, match="OPD_MODEL_MAX_TOKENIZER_BYTES"):
        model_files.check_model_folder(folder, "model", 4096)


def test_quota_settings_fail_fast() -> None:
    with pytest.raises(ValidationError, match="tenant_max_file_bytes must be at least max_upload_bytes"):
        Settings(tenant_max_file_bytes=MIB, max_upload_bytes=2 * MIB)
    for field, value in [
        ("tenant_max_files", 0),
        ("rate_limit_per_s", -1),
        ("rate_limit_burst", 0),
        ("event_stream_max_s", 0),
        ("event_streams_per_tenant", 0),
        ("dataset_validate_max_memory_bytes", MIB),
        ("dataset_max_line_bytes", 10),
    ]:
        with pytest.raises(ValidationError):
            Settings(**{field: value})


def test_nothing_lets_transformers_run_a_models_own_code() -> None:
    """`trust_remote_code` is never set to anything but False in the trainer, the server or the demo:
    a tenant's model folder is data, never code."""
    allowed = re.compile(r"trust_remote_code\s*=\s*False\b")
    offenders = []
    for folder in ("opd_trainer", "api", "rollout_workers", "reward_workers", "benchmarks", "scripts"):
        for path in sorted((REPO / folder).rglob("*.py")):
            for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
                if re.search(r"trust_remote_code\s*[=:]", line) and not allowed.search(line):
                    offenders.append(f"{path.relative_to(REPO)}:{number}: {line.strip()}")
    assert offenders == []
