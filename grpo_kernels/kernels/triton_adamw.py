"""Moved to :mod:`grpo.optim.triton_adamw`, beside the trainer's optimizer (``grpo.precision``), its one user.
This alias keeps the former import path: the module it gives is ``grpo.optim.triton_adamw`` itself.
"""

import sys

from grpo.optim import triton_adamw as _moved

sys.modules[__name__] = _moved
