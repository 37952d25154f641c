"""One rollout step: `gateway` (the per-job OpenAI-compatible endpoint that records the exact token
ids of every call), `runner` (sends samples through the rollout and reward pools and collects their
results), `chat` (rendering messages to prompt token ids with the model's template).
"""
