"""Test conventions.

- Without a GPU, Triton kernels run on CPU tensors through Triton's interpreter: TRITON_INTERPRET=1
  must be set before triton is first imported, so it is set here, at collection time.
- The shared helpers (``DEVICE``, ``assert_close64``, ``poison_``, ``tiny_config``) live in
  ``tests/helpers.py`` and are imported from there.
- ``@pytest.mark.gpu`` tests are skipped without CUDA.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from helpers import HAS_CUDA  # noqa: E402


@pytest.fixture
def one_thread():
    """Tiny tensors: one thread is fastest, and immune to other processes on the machine."""
    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(deterministic)


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
