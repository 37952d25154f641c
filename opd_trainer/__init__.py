"""OPD trainer engine: job spec, engines, learner, loss, weight sync, tiny models, CLI."""
