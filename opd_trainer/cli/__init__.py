"""The `opd` command: `main` (parser, local commands), `train` (`opd train`), `serve` (server commands)."""
