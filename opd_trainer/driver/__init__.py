"""Running a job: `job_driver` (the Ray actor that runs a job's steps end to end), `run_dir` (the run
directory's layout: the driver writes it, the server and CLI read it), `plots` (the curves),
`ray_runtime` and `ray_reaper` (starting or joining Ray, and cleaning up an embedded Ray when its
owner dies).
"""
