"""Running a job: `job_driver` (the Ray actor that runs a job's steps end to end), `launch` (how the
server starts it), `local_run` (a spec run on an embedded Ray from this process: `opd train`, `tune`),
`components` (a job's running parts, started once: engines, learner, gateways, pools), `teachers` (one
engine group per teacher and which teacher scores which sample), `step` (one training step, phase by
phase), `publish` (one weight publish from the learner to the student's engines), `validation`
(validation and the drift probe), `promotion` (which checkpoint becomes the job's model), `recovery`
(recovering from a lost component), `metering` (what a job used, and its budgets), `estimate` (`opd
estimate`: what a job will use, from a calibration run), `plots` (the curves), `trackers` (TensorBoard
and MLflow).
The training signal a step shapes lives in `opd_trainer/signal/`, the run directory's layout in
`opd_trainer/storage/`, starting or joining Ray in `opd_trainer/cluster/`.
"""
