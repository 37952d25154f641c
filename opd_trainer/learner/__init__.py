"""The learner: `deepspeed_learner` (DeepSpeed ranks as Ray actors, publishing weights), `loss` (the
distillation estimators and the policy loss), `checkpoint` (the checkpoint store).
"""
