"""GPU readiness without a GPU: compile the row kernels ahead of time for sm_80 and sm_90a.

Triton's NVIDIA backend needs no driver: ``triton.compile(ASTSource(...), target=GPUTarget("cuda",
cc, 32))`` runs LLVM and the ``ptxas`` shipped in Triton's wheel. ``benchmarks.aot``
captures the exact launch ``forward_rows`` / ``backward_rows`` make (meta tensors, so nothing is
allocated), specializes it as Triton's launcher would (16-byte alignment -> ``tt.divisibility``),
compiles it, and reads the cubin back with the wheel's ``cuobjdump``.

Every compilation runs in ONE subprocess (module-scoped fixture) with TRITON_INTERPRET unset:
conftest turns the interpreter on without a GPU, and then ``@triton.jit`` objects are
``InterpretedFunction`` objects that ``triton.compile`` cannot take. A private Triton cache makes
every variant really go through LLVM and ptxas.

Checked for each kernel x arch x logits dtype x vocabulary x flag set the launchers use:
- it compiles;
- no spills: cuobjdump's LOCAL and STACK are 0, and ptxas's own ``-v`` report agrees;
- with 16-byte-aligned rows, the logits are read with 128-bit loads (``LDG.E.128``), one per 16
  bytes of each thread's slice of a block, and the gradient stores of the backward are 128-bit
  (``STG.E.128``), but for one element-wide store: the target's exact term, written once per row.

Run with ``-s`` to see the table; set GRPO_AOT_REPORT=path.json to keep the full report.
"""

from __future__ import annotations

import json
import os

import pytest

from benchmarks import aot

VARIANTS = aot.default_variants()
IDS = [v.label for v in VARIANTS]


@pytest.fixture(scope="module")
def report():
    rep = aot.compile_in_subprocess(timeout=900)
    if "unsupported" in rep:
        pytest.skip(f"cannot compile for CUDA targets here: {rep['unsupported']}")
    rows = rep["rows"]
    env = rep["env"]
    print(f"\n\nAOT compile: triton {env['triton']}, ptxas {env['ptxas']}, {len(rows)} variants in {rep['seconds']} s")
    print(aot.format_table(rows))
    for r in rep["results"]:
        if r["error"]:
            print(f"  {r['label']}: {r['error'].splitlines()[0]}")
    path = os.environ.get("GRPO_AOT_REPORT")
    if path:
        with open(path, "w") as f:
            json.dump(rep, f, indent=1)
    by_label = {r["label"]: r for r in rep["results"]}
    assert set(by_label) == set(IDS), "the subprocess compiled other variants than this test expects"
    return by_label


def _compiled(report, label):
    r = report[label]
    if r["error"]:
        pytest.skip("did not compile: see test_compiles")
    return r


@pytest.mark.parametrize("label", IDS)
def test_compiles(report, label):
    r = report[label]
    assert not r["error"], f"{label} does not compile for sm_{r['arch']}:\n{r['error']}"
    assert r["regs"] > 0 and r["block_v"] > 0


@pytest.mark.parametrize("label", IDS)
def test_specialization_matches_triton_launcher(report, label):
    """The signature compiled here is the one Triton's launcher derives from the same values."""
    r = _compiled(report, label)
    assert not r["specialization_mismatches"], r["specialization_mismatches"]
    if r["row_aligned"]:
        for name in ("logits_ptr", "stride_t", "V"):
            assert name in r["divisible"], f"{name} should carry tt.divisibility=16: {r['divisible']}"


@pytest.mark.parametrize("label", IDS)
def test_no_spills(report, label):
    r = _compiled(report, label)
    assert r["local"] == 0, f"{label}: {r['local']} bytes of local memory (register spills), {r['regs']} registers"
    assert r["stack"] == 0, f"{label}: {r['stack']}-byte stack frame"
    ptxas = r["ptxas"]
    if ptxas:
        assert ptxas.get("spill_stores", 0) == 0 and ptxas.get("spill_loads", 0) == 0, ptxas
        assert ptxas.get("stack", 0) == 0, ptxas
        assert ptxas.get("regs", r["regs"]) == r["regs"], (ptxas, r["regs"])
    if r["metadata_spills"] is not None:  # filled by Triton only when a driver loads the binary
        assert r["metadata_spills"] == 0
    # A CTA must fit one SM's register file (64K 32-bit registers on sm_80 and sm_90).
    assert r["regs"] * r["num_warps"] * 32 <= 65536, (r["regs"], r["num_warps"])


@pytest.mark.parametrize("label", IDS)
def test_vectorized_global_access(report, label):
    r = _compiled(report, label)
    if not r["row_aligned"]:
        pytest.skip(f"V={r['vocab']}: rows are not 16-byte aligned, scalar accesses are expected (reference row)")
    elem = aot.BYTES[r["dtype"]]
    threads = r["num_warps"] * 32
    # 16-byte vectors per thread per block: each thread holds BLOCK_V / threads contiguous elements.
    vectors = r["block_v"] * elem // (threads * 16)
    assert vectors >= 1, f"{label}: BLOCK_V={r['block_v']} gives under 16 bytes per thread"
    ldg, stg = r["ldg"], r["stg"]
    assert ldg.get("128", 0) >= vectors, (
        f"{label}: logits not read with 128-bit loads: LDG widths {ldg}, expected >= {vectors} LDG.E.128"
    )
    if r["dtype"] == "bf16":
        # Only the target logit may be read on its own (16-bit); the block loads are all 128-bit.
        assert ldg.get("16", 0) <= 1, f"{label}: narrow logits loads {ldg}"
    if r["kernel"] == "bwd":
        narrow = {bits: n for bits, n in stg.items() if bits != "128"}
        element_bits = str(8 * elem)
        assert set(narrow) <= {element_bits} and sum(narrow.values()) <= 1, (
            f"{label}: gradient stores not 128-bit (one {element_bits}-bit store for the target allowed): "
            f"STG widths {stg}"
        )
        assert stg.get("128", 0) >= vectors, f"{label}: STG widths {stg}, expected >= {vectors} STG.E.128"
