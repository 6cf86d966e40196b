"""grpo_kernels.backends: "auto" picks the backend from the state Triton really runs in."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest


@pytest.mark.parametrize("order", ["kernels-then-variable", "triton-then-variable", "variable-then-kernels"])
def test_auto_backend_follows_the_state_triton_runs_in(order):
    """'auto' asks the decorated kernels (ours and Triton's own library) whether they are
    interpreted, not a variable set afterwards (e.g. after TRL imported Triton)."""
    script = textwrap.dedent(f"""
        import os
        os.environ.pop("TRITON_INTERPRET", None)
        if {order == "variable-then-kernels"!r}:
            os.environ["TRITON_INTERPRET"] = "1"
        if {order == "triton-then-variable"!r}:
            import triton.language  # another library imported Triton first
            os.environ["TRITON_INTERPRET"] = "1"  # too late for Triton's own tl.max, tl.sum...
        import torch
        import grpo_kernels as gk
        from grpo_kernels import backends
        from grpo_kernels.kernels import triton_rows
        if {order == "kernels-then-variable"!r}:
            os.environ["TRITON_INTERPRET"] = "1"  # too late: the kernels were compiled for a GPU
        chosen = backends.resolve("auto", torch.device("cpu")).name
        x = torch.randn(2, 3, 7)
        lp = gk.token_logprobs(x, torch.zeros(2, 3, dtype=torch.long))
        assert torch.allclose(lp, torch.log_softmax(x, -1)[..., 0], atol=1e-6)
        print(chosen)
    """)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    expected = "triton" if order == "variable-then-kernels" else "torch"
    assert result.stdout.strip().splitlines()[-1] == expected
