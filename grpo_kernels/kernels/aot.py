"""Moved to ``tools/aot.py``: the ahead-of-time compile check of the row kernels is a CI tool of the
repository, not part of the library. This alias keeps ``from grpo_kernels.kernels import aot`` and
``python -m grpo_kernels.kernels.aot`` working in a checkout (the module it gives is ``tools.aot`` itself);
an installed package has no ``tools``, and says so.
"""

from __future__ import annotations

import sys
from pathlib import Path

_ROOT = str(Path(__file__).resolve().parents[2])  # the repository root, in a checkout
if _ROOT not in sys.path:
    sys.path.append(_ROOT)
try:
    from tools import aot as _aot
except ImportError as e:
    raise ImportError("grpo_kernels.kernels.aot moved to tools/aot.py of the grpo-kernels repository (a CI tool, "
                      "not installed with the package): run it from a checkout as python -m tools.aot") from e

if __name__ == "__main__":
    sys.exit(_aot.main())
sys.modules[__name__] = _aot
