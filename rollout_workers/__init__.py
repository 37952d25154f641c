"""Autoscaled pool of Ray actors running the user's rollout processor."""
