"""The cluster: `ray_runtime` (starts or joins Ray), `ray_reaper` (ends an embedded Ray's processes
when the process that started it dies), `placement` (waits for Ray to place a job's actors and says
what is missing), `preemption` (notices of nodes about to go), `process_usage` (CPU-seconds of an
actor's process tree, for metering) and `ports` (a free TCP port).
The CLI, the job server, the driver and the benchmarks start and find Ray through these modules."""
