"""vLLM engines: the student samples, the teacher scores the student's exact tokens.

`vllm_engine` (engine actors, their settings and the group that spreads requests), `fleet` (the one
owner of engines' life: start, share, stop, replicas; a job's `EngineFleet`), `hosting` (services other
packages run in an engine's process, such as a job's gateways), `shared_engines` (the registry of teacher
engines, and LoRA jobs' student engines, the service shares between jobs),
`engine_sharing` (its settings and scaling policy), `fair_gate` (fair admission of several jobs'
requests to one engine), `adapters` (the LoRA adapters a student engine serves, one per job),
`version_gate` (the weight version sampled completions record, per job on an engine serving adapters),
`inproc_llm` (vLLM's engine core in the engine actor's own process, on a CPU node), `lengths` (how long a
completion may be after a prompt), `recent_scores` (the teacher's recent rows, for the positions the
prefix cache hides) and `engine_stats` (what an engine did, from vLLM's stat-logger hook). How
weights reach the engines (the transports and the vLLM worker extension) is `opd_trainer.weight_sync`,
a package below this one.
"""
