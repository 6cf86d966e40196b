"""Glue that plugs grpo-kernels into other trainers.

``grpo_kernels.integrations.trl``: TRL's ``GRPOTrainer`` (trl >= 1.15) with our fused log-prob head
(``patch()`` / ``unpatch()``, or the ``GRPOTrainer`` subclass). Each integration imports its trainer
library, so import the submodule you need; this package itself imports nothing heavy.
"""
