"""The job server's service layer: everything the thin route handlers call."""
