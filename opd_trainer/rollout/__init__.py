"""One rollout step: `gateway` (the per-job OpenAI-compatible endpoint that records the exact token
ids of every call), `chat_requests` (what a chat-completions request may ask and how it becomes a prompt
and sampling parameters), `tool_calls` (tool calls parsed by vLLM's parser for the model family),
`gateway_host` (a job's gateways in one process), `gateway_placement` (where a job's gateways run: in
the student's engine process), `runner` (sends samples through the rollout and reward pools and
collects their results), `agent_eval` (agent-level validation metrics) and `trajectory_view` (the
teacher's view of a trajectory's trained tokens, for the trajectory log). Prompts are rendered by
`opd_trainer/chat.py`.
"""
