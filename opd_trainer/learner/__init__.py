"""The learner: `deepspeed_learner` (DeepSpeed ranks as Ray actors: they train, export weights and save
their state into a checkpoint), `settings` (what a rank needs of the job), `batch` (the typed mini-batch
and the forward over it), `shared_prefix` (shared prompt prefixes forwarded once), `packing` (the plain
forward with a batch's rows packed into one), `estimators` (each estimator declared in
`jobspec/estimators.py` paired with its function), `loss` (their pure tensor functions),
`preference_loss` (the preference and beacon terms), `adapters` (LoRA adapters on the student with
PEFT) and `merged_models` (a LoRA checkpoint merged into a whole model where one is needed).
"""
