"""vLLM engines: the student samples, the teacher scores the student's exact tokens.

`vllm_engine` (engine actors and the group that spreads requests), `kv_cache` (CPU KV-cache sizing),
`weight_transfer` (one class per transport, `shm` / `ray`, owning the learner's and the engine's half of
moving weights), `vllm_extension` (the worker half that reloads them in place), `shared_teachers` (teacher
engines the service shares between jobs), `teacher_sharing` (its settings and scaling policy) and
`fair_gate` (fair admission of several jobs' requests to one engine).
"""
