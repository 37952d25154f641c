"""Job spec: defaults, strictness, field-named errors, file loading."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from opd_trainer.errors import ConfigError
from opd_trainer.jobspec.job_spec import (
    DEFAULT_DISTILL_LOSS,
    DEFAULT_TEACHER_TOP_K,
    JobSpec,
    load_job_spec,
    parse_job_spec,
)

MINIMAL = {"job_name": "j", "model": "s", "teacher_model": "t", "training_datasets": ["train.jsonl"]}


def test_minimal_spec_gets_documented_defaults() -> None:
    spec = parse_job_spec(MINIMAL)
    assert spec.hyper_parameters.kl_coef == 1.0
    assert spec.hyper_parameters.kl_loss_coef == 0.0
    assert spec.hyper_parameters.max_staleness == 0
    assert spec.resources.zero_stage == 2
    assert not spec.is_agentic
    # Rewards count when given; the context decides max_length; CPU engines size their own KV cache.
    assert spec.hyper_parameters.reward_coef == 1.0
    assert spec.hyper_parameters.max_length is None
    assert spec.resources.student.kv_cache_memory_bytes is None


def test_every_field_has_a_description() -> None:
    def walk(model: type) -> list[str]:
        missing = []
        for name, field in model.model_fields.items():  # type: ignore[attr-defined]
            if not field.description:
                missing.append(f"{model.__name__}.{name}")
            annotation = field.annotation
            if isinstance(annotation, type) and hasattr(annotation, "model_fields"):
                missing += walk(annotation)
        return missing

    assert walk(JobSpec) == []


@pytest.mark.parametrize(
    ("patch", "field"),
    [
        ({"bogus": 1}, "bogus"),
        ({"hyper_parameters": {"batch_size": "eight"}}, "hyper_parameters.batch_size"),
        ({"hyper_parameters": {"kl_coef": -1}}, "hyper_parameters.kl_coef"),
        ({"hyper_parameters": {"ratio_cap": 0.5}}, "hyper_parameters.ratio_cap"),
        ({"hyper_parameters": {"stale_divergence": "later"}}, "hyper_parameters.stale_divergence"),
        ({"hyper_parameters": {"lr_scheduler_type": "exotic"}}, "hyper_parameters.lr_scheduler_type"),
        ({"resources": {"student": {"replicas": 0}}}, "resources.student.replicas"),
        ({"resources": {"teacher": {"gpu_fraction": 0}}}, "resources.teacher.gpu_fraction"),
        (
            {"resources": {"teacher": {"gpu_fraction": 0.5, "tensor_parallel_size": 2}}},
            "resources.teacher",
        ),
        ({"resources": {"learner_gpu_fraction": 1.5}}, "resources.learner_gpu_fraction"),
        ({"training_datasets": []}, "training_datasets"),
        ({"auxiliary_models": {"judge": "gpt-4o"}}, "auxiliary_models.judge"),
        (
            {"functions": [{"name": "r", "type": "reward", "fcmodel": {"classpath": "a.B"}}]},
            "functions.0.fcmodel",
        ),
        (
            {
                "functions": [
                    {
                        "name": "r",
                        "type": "reward",
                        "fcmodel": {"zipdir": "w", "classpath": "a.B"},
                        "runtime": {"min_capacity": 3, "capacity": 1},
                    }
                ]
            },
            "functions.0.runtime",
        ),
    ],
)
def test_bad_fields_are_named(patch: dict, field: str) -> None:
    with pytest.raises(ConfigError) as raised:
        parse_job_spec({**MINIMAL, **patch})
    assert raised.value.field == field
    assert field in str(raised.value)


def test_the_teacher_can_be_served_to_processors_by_name() -> None:
    assert parse_job_spec({**MINIMAL, "auxiliary_models": {"judge": "teacher"}}).auxiliary_models == {
        "judge": "teacher"
    }
    assert parse_job_spec(MINIMAL).auxiliary_models == {}


def test_one_gpu_can_be_shared() -> None:
    shares = {"student": {"gpu_fraction": 0.3}, "teacher": {"gpu_fraction": 0.3}, "learner_gpu_fraction": 0.4}
    resources = parse_job_spec({**MINIMAL, "resources": shares}).resources
    assert (resources.student.gpu_fraction, resources.learner_gpu_fraction) == (0.3, 0.4)


def test_two_rollout_components_rejected() -> None:
    rollout = {"type": "rollout", "fcmodel": {"zipdir": "w", "classpath": "a.B"}}
    with pytest.raises(ConfigError, match="at most one rollout"):
        parse_job_spec({**MINIMAL, "functions": [{"name": "a", **rollout}, {"name": "b", **rollout}]})


def _component(name: str, kind: str) -> dict:
    return {"name": name, "type": kind, "fcmodel": {"zipdir": "w", "classpath": "f.C"}}


def test_evaluator_component_rules() -> None:
    with_validation = {**MINIMAL, "validation_datasets": ["v.jsonl"]}
    spec = parse_job_spec({**with_validation, "functions": [_component("ev", "evaluator")]})
    assert [c.name for c in spec.evaluator_components] == ["ev"]
    assert not spec.is_agentic and spec.reward_components == []
    with pytest.raises(ConfigError, match="at most one evaluator"):
        parse_job_spec(
            {**with_validation, "functions": [_component("a", "evaluator"), _component("b", "evaluator")]}
        )
    with pytest.raises(ConfigError, match="validation_datasets"):
        parse_job_spec({**MINIMAL, "functions": [_component("ev", "evaluator")]})


def test_yaml_file_paths_resolve_against_its_folder(tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.jsonl").write_text("{}\n")
    job = tmp_path / "job.yaml"
    job.write_text(
        "job_name: j\nmodel: hub/model-name\nteacher_model: t\ntraining_datasets: [data/train.jsonl]\n"
    )
    spec = load_job_spec(job)
    assert spec.training_datasets == [str((tmp_path / "data" / "train.jsonl").resolve())]
    assert spec.model == "hub/model-name"  # not a local path: left alone


def test_unreadable_or_invalid_job_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as raised:
        load_job_spec(tmp_path / "missing.yaml")
    assert raised.value.field == "job_file"
    bad = tmp_path / "bad.yaml"
    bad.write_text("job_name: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid"):
        load_job_spec(bad)
    listing = tmp_path / "list.yaml"
    listing.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_job_spec(listing)


# -- Bailian job documents ------------------------------------------------------------------------

BAILIAN = {
    **MINIMAL,
    "training_datasets": [{"data_source_type": "FILE_ID", "file_name": "data/train.jsonl"}],
    "validation_datasets": [{"data_source_type": "FILE_ID", "file_name": "file-abc"}, "val.jsonl"],
    "hyper_parameters": {"batch_size": 4, "opd_teacher_replicas": 2, "opd_teacher_spec": {"gpu": "A10"}},
    "resources": {
        "charge_type": "mtu_postpaid",
        "mtu_spec_code": "MTU4",
        "mtu_capacity": 24,
        "learner_gpus": 0,
    },
}
IGNORED = {
    "resources.charge_type": "mtu_postpaid",
    "resources.mtu_spec_code": "MTU4",
    "resources.mtu_capacity": 24,
    "hyper_parameters.opd_teacher_replicas": 2,
    "hyper_parameters.opd_teacher_spec": {"gpu": "A10"},
}


def test_bailian_job_is_accepted_with_its_only_fields_set_aside() -> None:
    spec = parse_job_spec(BAILIAN)
    assert spec.training_datasets == ["data/train.jsonl"]
    assert spec.validation_datasets == ["file-abc", "val.jsonl"]
    assert spec.ignored_fields == IGNORED
    assert (spec.hyper_parameters.batch_size, spec.resources.learner_gpus) == (4, 0)  # the rest applies
    assert parse_job_spec(MINIMAL).ignored_fields == {}


def test_bailian_job_survives_the_servers_storage_round_trip() -> None:
    spec = parse_job_spec(BAILIAN)
    stored = json.loads(json.dumps(spec.model_dump(mode="json", exclude_none=True)))  # as api/ keeps it
    assert stored["ignored_fields"] == IGNORED and stored["training_datasets"] == ["data/train.jsonl"]
    assert JobSpec.model_validate(stored) == spec


def test_dataset_objects_in_any_case_and_as_objects() -> None:
    from opd_trainer.jobspec.job_spec import DatasetSource, DataSourceType

    spec = parse_job_spec(
        {
            **MINIMAL,
            "training_datasets": [
                {"data_source_type": "file_id", "file_name": "a.jsonl"},
                {"file_name": "b.jsonl"},
                DatasetSource(data_source_type=DataSourceType.FILE_ID, file_name="c.jsonl"),
            ],
        }
    )
    assert spec.training_datasets == ["a.jsonl", "b.jsonl", "c.jsonl"]


@pytest.mark.parametrize(
    ("patch", "field", "named"),
    [
        ({"resources": {"charge": "mtu_postpaid"}}, "resources.charge", "Extra inputs"),
        ({"hyper_parameters": {"opd_student_replicas": 2}}, "hyper_parameters.opd_student_replicas", "Extra"),
        ({"mtu_capacity": 24}, "mtu_capacity", "Extra inputs"),  # only under resources, as in Bailian
        (
            {"training_datasets": [{"data_source_type": "OSS", "file_name": "a"}]},
            "training_datasets.0",
            "data_source_type",
        ),
        ({"training_datasets": [{"file_name": "a", "path": "b"}]}, "training_datasets.0", "path"),
        ({"validation_datasets": [{"data_source_type": "FILE_ID"}]}, "validation_datasets.0", "file_name"),
        ({"ignored_fields": {"resources.zero_stage": 1}}, "ignored_fields", "resources.zero_stage"),
    ],
)
def test_unknown_fields_are_still_errors_naming_the_field(patch: dict, field: str, named: str) -> None:
    with pytest.raises(ConfigError) as raised:
        parse_job_spec({**BAILIAN, **patch})
    assert raised.value.field == field
    assert named in str(raised.value)


def test_yaml_dataset_objects_resolve_against_its_folder(tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.jsonl").write_text("{}\n")
    job = tmp_path / "job.yaml"
    job.write_text(
        "job_name: j\nmodel: m\nteacher_model: t\n"
        "training_datasets:\n- {data_source_type: FILE_ID, file_name: data/train.jsonl}\n"
        "resources: {charge_type: mtu_postpaid}\n"
    )
    spec = load_job_spec(job)
    assert spec.training_datasets == [str((tmp_path / "data" / "train.jsonl").resolve())]
    assert spec.ignored_fields == {"resources.charge_type": "mtu_postpaid"}


def test_the_teachers_top_k_defaults_to_what_the_estimator_reads() -> None:
    hp = parse_job_spec(MINIMAL).hyper_parameters
    assert (hp.distill_loss, hp.jsd_beta) == (DEFAULT_DISTILL_LOSS, 0.5)
    assert hp.teacher_top_k == (0 if DEFAULT_DISTILL_LOSS == "sampled" else DEFAULT_TEACHER_TOP_K)
    for estimator in ("sampled_baseline", "topk_reverse", "topk_forward", "jsd"):
        hp = parse_job_spec({**MINIMAL, "hyper_parameters": {"distill_loss": estimator}}).hyper_parameters
        assert hp.teacher_top_k == DEFAULT_TEACHER_TOP_K
    sampled = parse_job_spec({**MINIMAL, "hyper_parameters": {"distill_loss": "sampled"}}).hyper_parameters
    assert sampled.teacher_top_k == 0  # not paid for where nothing reads it


@pytest.mark.parametrize("estimator", ["sampled_baseline", "topk_reverse", "topk_forward", "jsd"])
def test_top_k_estimators_need_the_teachers_top_k(estimator: str) -> None:
    with pytest.raises(ConfigError) as raised:
        parse_job_spec({**MINIMAL, "hyper_parameters": {"distill_loss": estimator, "teacher_top_k": 0}})
    assert raised.value.field == "hyper_parameters.teacher_top_k"
    assert f"distill_loss {estimator} needs hyper_parameters.teacher_top_k >= 1" in raised.value.message
    spec = parse_job_spec({**MINIMAL, "hyper_parameters": {"distill_loss": estimator, "teacher_top_k": 8}})
    assert spec.hyper_parameters.teacher_top_k == 8


@pytest.mark.parametrize("beta", [0.0, 1.0])
def test_jsd_beta_is_strictly_between_the_kls(beta: float) -> None:
    with pytest.raises(ConfigError) as raised:
        parse_job_spec({**MINIMAL, "hyper_parameters": {"jsd_beta": beta}})
    assert raised.value.field == "hyper_parameters.jsd_beta"


def _with_env(env: dict[str, str]) -> dict:
    component = {**_component("judge", "reward"), "runtime": {"env": env}}
    return {**MINIMAL, "functions": [component]}


@pytest.mark.parametrize(
    "name",
    [
        "LD_PRELOAD",
        "LD_LIBRARY_PATH",
        "PYTHONPATH",
        "PYTHONSTARTUP",
        "PYTHONHOME",
        "BASH_ENV",
        "ENV",
        "PATH",
        "HOME",
        "IFS",
        "SHELLOPTS",
        "PS4",
        "PERL5OPT",
        "RUBYOPT",
        "NODE_OPTIONS",
        "GCONV_PATH",
        "MALLOC_CHECK_",
        "GLIBC_TUNABLES",
        "LOCPATH",
        "TMPDIR",
        "VIRTUAL_ENV",
        "PIP_INDEX_URL",
        "SSL_CERT_FILE",
        "REQUESTS_CA_BUNDLE",
        "OPD_ADMIN_KEY",
        "RAY_ADDRESS",
        "CUDA_VISIBLE_DEVICES",
        "NCCL_SOCKET_IFNAME",
    ],
)
def test_runtime_env_refuses_what_changes_how_processes_start_or_the_service_owns(name: str) -> None:
    with pytest.raises(ConfigError) as raised:
        parse_job_spec(_with_env({name: "x"}))
    assert raised.value.field == "functions.0.runtime"
    assert f"functions.judge.runtime.env.{name}: not settable by a job: " in raised.value.message


@pytest.mark.parametrize("name", ["1ST", "A-B", "A B", "A=B", "", "X\x00", "É"])
def test_runtime_env_names_are_plain_identifiers(name: str) -> None:
    with pytest.raises(ConfigError, match=r"functions\.judge\.runtime\.env: .* is not a variable name"):
        parse_job_spec(_with_env({name: "x"}))


@pytest.mark.parametrize("value", ["x" * 4097, "a\x00b"])
def test_runtime_env_values_are_bounded_and_without_nul(value: str) -> None:
    with pytest.raises(ConfigError, match=r"functions\.judge\.runtime\.env\.MY_SETTING: the value must be"):
        parse_job_spec(_with_env({"MY_SETTING": value}))


def test_runtime_env_keeps_the_components_own_variables() -> None:
    env = {"OMP_NUM_THREADS": "2", "MY_API_BASE": "http://judge", "_x": "y" * 4096, "Path": "lowercase ok"}
    spec = parse_job_spec(_with_env(env))
    assert spec.functions[0].runtime.env == env
