"""Tool-routing agent and rewards for OPD: the workspace a user would upload."""
