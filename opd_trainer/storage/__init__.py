"""Storage: the run directory's layout, checkpoints, the shared-storage probe, and zips (safe
extraction of uploaded workspaces, streamed downloads of folders). The server, the driver, the learner
and the client read and write runs through these modules only."""
