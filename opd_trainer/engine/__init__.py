"""vLLM engines: the student samples, the teacher scores the student's exact tokens.

`vllm_engine` (engine actors and the group that spreads requests), `kv_cache` (CPU KV-cache sizing),
`shared_teachers` (teacher engines the service shares between jobs), `teacher_sharing` (its settings
and scaling policy) and `fair_gate` (fair admission of several jobs' requests to one engine). How
weights reach the engines (the transports and the vLLM worker extension) is `opd_trainer.weight_sync`,
a package below this one.
"""
