"""Test conventions.

- Without a GPU, Triton kernels run on CPU tensors through Triton's interpreter: TRITON_INTERPRET=1
  must be set before triton is first imported, so it is set here, at collection time.
- The shared helpers (``DEVICE``, ``assert_close64``, ``poison_``, ``tiny_config``) live in
  ``tests/helpers.py`` and are imported from there.
- ``@pytest.mark.gpu`` tests are skipped without CUDA.
- Under pytest-xdist (``make test``: ``-n auto``) each test file runs whole in one worker (its module
  fixtures made once, its tests in file order), except the files in ``SPLIT_BY_TEST``, long files whose
  tests are each independent: those are spread over the workers one test function (all its
  parametrized cases) at a time, so that no single file sets the suite's wall time
  (``FileOrFunctionScheduling``, the scheduler this file gives xdist for any ``--dist``).
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


@pytest.fixture(scope="session", autouse=True)
def _children_are_not_xdist_workers():
    """A pytest that a test starts (tests/test_benchmarks_kernels.py runs ``pytest benchmarks/
    --benchmark-only``) must not inherit an xdist worker's PYTEST_XDIST_* variables: pytest-benchmark
    reads PYTEST_XDIST_WORKER and then refuses --benchmark-only."""
    saved = {name: os.environ.pop(name) for name in list(os.environ) if name.startswith("PYTEST_XDIST_")}
    yield
    os.environ.update(saved)


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


try:
    from xdist.scheduler import LoadScopeScheduling
except ImportError:  # (pytest-xdist is in the test extra; without it the suite runs in one process)
    LoadScopeScheduling = None

if LoadScopeScheduling is not None:

    class FileOrFunctionScheduling(LoadScopeScheduling):
        """xdist's scope scheduling (work units handed to idle workers, the units with most tests first)
        with these units: a whole test file, or, in the files of ``SPLIT_BY_TEST``, one test function with
        all its parametrized cases. (xdist's own ``xdist_group`` marks cannot do this under pytest 9: its
        worker renames a test's node id through an attribute that pytest 9 no longer reads.)"""

        def _split_scope(self, nodeid: str) -> str:
            path, _, rest = nodeid.partition("::")
            if path.rsplit("/", 1)[-1] in SPLIT_BY_TEST:
                return f"{path}::{rest.split('[')[0]}"
            return path

    @pytest.hookimpl(optionalhook=True)  # (`-p no:xdist` leaves the hook unknown)
    def pytest_xdist_make_scheduler(config, log):
        return FileOrFunctionScheduling(config, log)
