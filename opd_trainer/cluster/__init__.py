"""The cluster: the embedded Ray runtime and its reaper, placement of actors on nodes, free ports.
The CLI, the job server, the driver and the benchmarks start and find Ray through these modules."""
