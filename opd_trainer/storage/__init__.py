"""Storage: `run_dir` (the run directory's layout), `checkpoints` (`step-N/` folders written whole, the
`latest` pointer), `shared` (the probe that the server, driver and learner see the same run directory),
`zips` (a workspace packed, checked and safely extracted) and `zip_stream` (a folder streamed as a zip,
for downloads). The server, the driver, the learner and the client read and write runs through these
modules only."""
