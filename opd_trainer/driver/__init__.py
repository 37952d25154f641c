"""Running a job: `job_driver` (the Ray actor that runs a job's steps end to end), `launch` (how the
server starts it), `local_run` (a spec run on an embedded Ray from this process: `opd train`, `tune`),
`plots` (the curves), `trackers` (TensorBoard/MLflow/W&B), `teacher_hindsight` (the teacher scoring
with the reference in view). The run directory's layout lives in `opd_trainer/storage/`, starting or
joining Ray in `opd_trainer/cluster/`.
"""
