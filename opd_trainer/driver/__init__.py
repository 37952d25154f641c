"""Running a job: `job_driver` (the Ray actor that runs a job's steps end to end), `launch` (how the
CLI and the server start it), `plots` (the curves), `trackers` (TensorBoard/MLflow/W&B),
`teacher_hindsight` (the teacher scoring with the reference in view). The run directory's layout lives
in `opd_trainer/storage/`, starting or joining Ray in `opd_trainer/cluster/`.
"""
