"""Test conventions.

- Without a GPU, Triton kernels run on CPU tensors through Triton's interpreter: TRITON_INTERPRET=1
  must be set before triton is first imported, so it is set here, at collection time.
- The shared helpers (``DEVICE``, ``assert_close64``, ``poison_``, ``tiny_config``) live in
  ``tests/helpers.py`` and are imported from there.
- ``@pytest.mark.gpu`` tests are skipped without CUDA.
- Under pytest-xdist (``make test``: ``-n auto --dist loadgroup``) each test file runs whole in one
  worker (its module fixtures made once, its tests in file order), except the files in ``SPLIT_BY_TEST``,
  long files whose tests are each independent: those are spread over the workers one test function
  (all its parametrized cases) at a time, so that no single file sets the suite's wall time.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from helpers import HAS_CUDA  # noqa: E402


# Long test files spread over the xdist workers by test function (see the module docstring): the
# interpreter- and compile-heavy ones, whose few slowest functions would otherwise run one after another
# in one worker. None of them uses a module-scoped fixture (each worker would make it again).
SPLIT_BY_TEST = frozenset({"test_functional.py", "test_objective.py", "test_replay.py", "test_triton_ops.py",
                           "test_triton_replay.py", "test_truncation_tensors.py"})


@pytest.fixture
def one_thread():
    """Tiny tensors: one thread is fastest, and immune to other processes on the machine."""
    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(deterministic)


def pytest_collection_modifyitems(config, items):
    grouped = config.pluginmanager.hasplugin("xdist")
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if not HAS_CUDA and "gpu" in item.keywords:
            item.add_marker(skip_gpu)
        if grouped:
            path = item.nodeid.split("::")[0]
            split = path.rsplit("/", 1)[-1] in SPLIT_BY_TEST
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("[")[0] if split else path))
