"""verl's plugin hook: importing this module calls ``grpo_kernels.integrations.verl.patch()``.

verl 0.9 imports every ``verl.plugins`` entry point when ``verl`` itself is imported (``verl/__init__.py``,
``VERL_USE_EXTERNAL_PLUGINS``: ``auto`` by default, ``none`` for no plugins, or a comma list of names),
in the driver and in every worker process. grpo-kernels' pyproject declares this module as the entry
point ``grpo_kernels``, so an install of ``grpo-kernels[verl]`` is all a verl user does; the same module
can be named in ``VERL_USE_EXTERNAL_MODULES`` instead. verl swallows a plugin's exception with a debug
record, so a failure is logged here as a warning first (verl's own kernel then runs).
"""

from __future__ import annotations

import logging

from .verl import patch

try:
    patch()
except Exception as error:  # verl would hide it: say it, then let verl do what it does
    logging.getLogger(__name__).warning("grpo-kernels could not patch verl's fused kernel (verl's own runs): %s: %s",
                                        type(error).__name__, error)
    raise
