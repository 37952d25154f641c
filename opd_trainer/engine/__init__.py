"""vLLM engines: the student samples, the teacher scores the student's exact tokens.

`vllm_engine` (engine actors and the group that spreads requests), `kv_cache` (CPU KV-cache sizing),
`weight_sync` and `vllm_extension` (how the learner's weights reach a running engine).
"""
