"""Running a job: `job_driver` (the Ray actor that runs a job's steps end to end), `metrics_log` and
`plots` (the run directory's metrics and curves), `ray_runtime` and `ray_reaper` (starting or joining
Ray, and cleaning up an embedded Ray when its owner dies).
"""
