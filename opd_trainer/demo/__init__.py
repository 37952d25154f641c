"""The demo and test fixtures: `tiny_models` (a tiny student and teacher made on disk) and
`tool_routing` (the tool-routing task and its evaluator), `roundtrip` (the generate → score →
weight-sync check on them behind `opd roundtrip`). The trainer never imports this package;
the examples, benchmarks, tests and `opd make-tiny-models` do.
"""
