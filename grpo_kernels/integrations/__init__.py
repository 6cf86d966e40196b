"""Glue that plugs grpo-kernels into other trainers.

``grpo_kernels.integrations.trl``: TRL's ``GRPOTrainer`` (trl >= 1.16) with our fused log-prob head
(``patch()`` / ``unpatch()``, or the ``GRPOTrainer`` subclass).
``grpo_kernels.integrations.verl``: verl 0.9's fused log-prob/entropy kernel (``linear_cross_entropy``)
replaced by ours in verl's own forwards (``patch()`` / ``unpatch()``; ``verl_plugin`` is the
``verl.plugins`` entry point that calls ``patch()`` when verl is imported).
``grpo_kernels.integrations.openrlhf``: OpenRLHF's ``Actor.forward`` with our fused log-prob/entropy
head (``patch()`` / ``unpatch()``). ``_host``: the tested host releases and the checks each ``patch()``
runs (docs/integrations.md). Import the submodule you need; this package itself imports nothing heavy.
"""
