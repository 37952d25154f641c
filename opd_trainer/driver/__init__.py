"""Running a job: `job_driver` (the Ray actor that runs a job's steps end to end), `launch` (how the
server starts it), `local_run` (a spec run on an embedded Ray from this process: `opd train`, `tune`),
`step` (one training step, phase by phase), `plots` (the curves), `trackers` (TensorBoard/MLflow/W&B).
The training signal a step shapes lives in `opd_trainer/signal/`, the run directory's layout in
`opd_trainer/storage/`, starting or joining Ray in `opd_trainer/cluster/`.
"""
