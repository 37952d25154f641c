"""The job spec: `job_spec` (the one pydantic model of a job), `dataset` (the datasets it names, validated
line by line, and the epoch cursor), `model_source` (a model from a local folder or a Hugging Face id),
`estimators` (what each distillation estimator is, declared for the spec without the learner),
`base_teacher` (a LoRA job's teacher that is its student's base model), `job_status` (a job's statuses on
the server), and the pre-flight checks: `preflight` (checks that refuse a job before step 0 with a
reason the user can act on), `lora_check` (the student can take the `lora` adapters) and `memory_plan`
(each role's memory, so a job that cannot fit is refused before any engine starts)."""
