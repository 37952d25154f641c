"""The learner: `deepspeed_learner` (DeepSpeed ranks as Ray actors, publishing weights and checkpoints),
`settings` (what a rank needs of the job), `batch` (the typed mini-batch and the forward over it),
`estimators` (each distillation estimator declared once), `loss` (their pure tensor functions),
`shared_prefix` (shared prompt prefixes forwarded once), `preference_loss` (the preference and
beacon terms), `checkpoint` (the checkpoint store).
"""
