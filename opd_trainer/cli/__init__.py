"""The `opd` command: `main` (the parser and the local commands), `arguments` (argument types the
commands share), `train` (`opd train` and `opd estimate`), `preview` (`opd preview`: a dataset as the
trainer reads it), `serve` (`opd serve`: the job server) and `client_commands` (the commands that talk
to a job server: jobs, files, keys, webhooks)."""
