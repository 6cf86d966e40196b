"""grpo_kernels/loss_modes.py: one registered entry per loss mode, and everything read from it.

The option choices and the derived name lists follow the registry (a toy mode registered by a
fixture, and removed after, is a choice at once and runs through the torch and Triton backends); the
metrics each mode logs are its entry's; the docs' tables list exactly the registered modes with their
reduction, clipping and fused-or-not; the Triton launcher dispatches by the entry's epilogue id.
"""

from __future__ import annotations

import pathlib
from typing import Dict, List

import pytest
import torch
from helpers import DEVICE, assert_close64, batch

import grpo_kernels as gk
from grpo_kernels import backends, loss_modes, options
from grpo_kernels.bounds import OptionError
from grpo_kernels.loss_modes import PolicyInputs, PolicyTerms

DOCS = pathlib.Path(__file__).resolve().parent.parent / "docs" / "api.md"


# --------------------------------------------------------------------------------------------------
# the docs' tables are the registry's
# --------------------------------------------------------------------------------------------------
def _cells(line: str) -> List[str]:
    """A markdown table row's cells; a ``|`` inside backticks belongs to its cell."""
    cells, cell, code = [], "", False
    for ch in line.strip().strip("|"):
        if ch == "`":
            code = not code
        if ch == "|" and not code:
            cells.append(cell.strip())
            cell = ""
        else:
            cell += ch
    return cells + [cell.strip()]


def _table(header: str) -> Dict[str, Dict[str, str]]:
    """name -> {column: cell} of the docs table whose first header cell is ``header``."""
    lines = DOCS.read_text().splitlines()
    start = next(i for i, line in enumerate(lines)
                 if line.startswith(f"| {header} |") and lines[i + 1].startswith("|---"))
    columns = _cells(lines[start])
    rows = {}
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        cells = _cells(line)
        rows[cells[0].strip("`")] = dict(zip(columns, cells))
    return rows


@pytest.mark.parametrize("vocabulary, header", [(loss_modes.LOSS_TYPE, "`loss_type`"),
                                                 (loss_modes.LOSS_MODE, "`loss_mode`")])
def test_docs_tables_list_the_registered_modes(vocabulary, header):
    table = _table(header)
    registered = [m for m in loss_modes.REGISTRY.values() if m.vocabulary == vocabulary]
    assert list(table) == [m.name for m in registered]  # every mode, in registration order
    for mode in registered:
        row = table[mode.name]
        assert row["clipping"] == f"`{mode.clipping}`", mode.name
        assert row["fused"].startswith("Triton epilogue") == mode.fused, mode.name
        if not mode.fused:
            assert row["fused"].startswith("no"), mode.name
        if not mode.token_local:
            assert row["fused"] in ("no (sequence-level)", "no (batch-level)"), mode.name
        if not mode.is_verl:
            assert row["reduction"].startswith(f"`{mode.reduction}`"), mode.name
        elif mode.reduction is not None:  # forced: verl's sapo
            assert "always" in row["reduction"] and mode.reduction in row["reduction"], mode.name
        else:
            assert row["reduction"].startswith("`loss_agg_mode`") or "mean over rows" in row["reduction"], mode.name


# --------------------------------------------------------------------------------------------------
# the names derived from the registry
# --------------------------------------------------------------------------------------------------
def test_the_built_in_modes_and_what_is_derived_from_them():
    assert options.LOSS_TYPES == ("grpo", "bnpo", "dr_grpo", "dapo", "luspo", "cispo", "sapo", "vespo")
    assert options.LOSS_MODES == ("vanilla", "gspo", "sapo", "gpg", "clip_cov", "kl_cov", "geo_mean", "cispo",
                                  "dppo_tv", "dppo_kl", "dro")
    assert options.CLIPPED_LOSS_TYPES == ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")
    assert set(options.TOKEN_NORMALISED_LOSS_TYPES) == {"dapo", "bnpo", "cispo", "vespo"}
    assert options.DIVERGENCE_CLIP_LOSS_MODES == ("dppo_tv", "dppo_kl")
    assert dict(options.VERL_CLIP_RATIO_C_DEFAULTS) == {"vanilla": 3.0, "dppo_tv": 20.0, "dppo_kl": 20.0}
    # the declarations hold the views themselves (GRPOConfig's and the command lines' choices too)
    assert options.OPTION_DECLARATIONS["loss_type"].choices is options.LOSS_TYPES
    assert options.OPTION_DECLARATIONS["loss_mode"].choices is options.LOSS_MODES
    # the fused modes: token-local ones with an epilogue id (TRL's and verl's sapo share the gate)
    fused = {(m.vocabulary, m.name): m.epilogue for m in loss_modes.REGISTRY.values() if m.fused}
    assert all(loss_modes.REGISTRY[key].token_local for key in fused)
    assert {m.name for m in loss_modes.REGISTRY.values() if m.is_verl and m.fused} == {
        "vanilla", "sapo", "gpg", "cispo", "dppo_tv", "dppo_kl", "dro"}
    assert {m.name for m in loss_modes.REGISTRY.values() if not m.is_verl and not m.fused} == {"vespo"}


def test_each_mode_logs_its_entrys_metrics():
    logits, ids, mask, adv, old, ref, _ = batch(3)
    for mode in loss_modes.REGISTRY.values():
        kw = dict(loss_mode=mode.name, dro_beta=0.1) if mode.is_verl else dict(loss_type=mode.name)
        out = gk.grpo_loss(logits, ids, adv, mask, old_logps=old, ref_logps=ref, beta=0.04, backend="torch", **kw)
        if mode.is_verl:
            logged = {k for k in out.metrics if k in loss_modes.VERL_POLICY_METRICS}
            assert logged == set(mode.metrics), mode.name
        else:
            assert set(out.metrics) == {"kl", "entropy", *mode.metrics}, mode.name


def test_register_refuses_what_it_cannot_derive_from():
    term = lambda x: PolicyTerms(-x.adv * x.logp, torch.exp(x.logp - x.old).detach(), None)  # noqa: E731
    for kw, words in ((dict(loss_type="dapo", reduction="token_mean"), "registered already"),
                      (dict(loss_type="a", loss_mode="b", reduction="token_mean"), "one name"),
                      (dict(loss_type="new"), "reduction"),
                      (dict(loss_mode="new", clipping="sometimes"), "clipping"),
                      (dict(loss_mode="new", metrics=("clip_ratio/low_mean",)), "metrics")):
        with pytest.raises(ValueError, match=words):
            loss_modes.register_loss_mode(**kw)(term)
    assert "new" not in options.LOSS_TYPES and "new" not in options.LOSS_MODES


# --------------------------------------------------------------------------------------------------
# a new mode is one registered entry
# --------------------------------------------------------------------------------------------------
def _reinforce(x: PolicyInputs) -> PolicyTerms:
    """REINFORCE: ``-A logp`` (no ratio, no clip)."""
    return PolicyTerms(-x.adv.expand_as(x.mask) * x.logp, torch.exp(x.logp - x.old).detach(), None,
                       ppo_kl=(x.old - x.logp).detach())


@pytest.fixture
def toy_modes():
    """A toy TRL loss type and a toy verl loss mode, one registered entry each, removed afterwards."""
    loss_modes.register_loss_mode(loss_type="toy_reinforce", reduction="global_token_mean")(_reinforce)
    loss_modes.register_loss_mode(loss_mode="toy_pg", metrics=("actor/ppo_kl",))(_reinforce)
    try:
        yield
    finally:
        loss_modes.unregister_loss_mode(loss_type="toy_reinforce")
        loss_modes.unregister_loss_mode(loss_mode="toy_pg")


def _reinforce64(logits, ids, adv, mask):
    """float64: ``sum(-A logp m) / sum(m)`` and its gradient w.r.t. the logits."""
    x = logits.detach().double().requires_grad_(True)
    logp = torch.log_softmax(x, -1).gather(-1, ids.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    m = mask.double()
    loss = (-adv.double() * logp * m).sum() / m.sum()
    loss.backward()
    return loss.detach(), x.grad


def test_a_registered_mode_is_a_choice_everywhere(toy_modes):
    assert "toy_reinforce" in options.LOSS_TYPES and options.LOSS_TYPES[-1] == "toy_reinforce"
    assert "toy_reinforce" in options.TOKEN_NORMALISED_LOSS_TYPES  # (its reduction divides by the token count)
    assert "toy_reinforce" not in options.CLIPPED_LOSS_TYPES
    assert "toy_pg" in options.LOSS_MODES and "toy_pg" not in options.DIVERGENCE_CLIP_LOSS_MODES
    assert "toy_pg" not in options.VERL_CLIP_RATIO_C_DEFAULTS
    assert options.OPTION_DECLARATIONS["loss_type"].check("toy_reinforce") == "toy_reinforce"
    for kw in (dict(loss_type="toy_reinforce"), dict(loss_mode="toy_pg")):
        opts = gk.GRPOOptions(**kw)
        assert gk.objective.is_token_local(opts)
        assert not backends.TritonBackend().fuses(opts)  # no epilogue id: the row kernel, then the torch maths
    from grpo_kernels.kernels import triton_rows

    assert not triton_rows.fuses_objective("toy_reinforce", None)
    x, t, w = torch.randn(1, 2, 5), torch.zeros(1, 2, dtype=torch.long), torch.ones(1, 2)
    with pytest.raises(ValueError, match="loss_type 'toy_reinforce' has no fused Triton forward"):
        triton_rows.grpo_forward_rows(x, t, w, w, None, None, None, 1.0, -100, 0.2, 0.2, None, 0.0, 0.0,
                                      loss_type="toy_reinforce")


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("vocabulary", ["loss_type", "loss_mode"])
def test_a_registered_mode_runs_and_equals_its_formula(toy_modes, backend, vocabulary):
    logits, ids, mask, adv, old, _, _ = batch(11)
    logits, ids, mask, adv = logits.to(DEVICE), ids.to(DEVICE), mask.to(DEVICE), adv.to(DEVICE)
    kw = dict(loss_type="toy_reinforce") if vocabulary == "loss_type" else dict(loss_mode="toy_pg")
    x = logits.clone().requires_grad_(True)
    out = gk.grpo_loss(x, ids, adv, mask, old_logps=old.to(DEVICE), backend=backend, **kw)
    out.loss.backward()
    loss64, grad64 = _reinforce64(logits, ids, adv, mask)
    assert_close64(out.loss, loss64, what="loss")
    assert_close64(x.grad, grad64, what="grad")
    if vocabulary == "loss_mode":
        assert set(out.metrics) >= {"actor/ppo_kl", "actor/entropy"}
        assert not set(out.metrics) & {"actor/pg_clipfrac", "actor/pg_clipfrac_lower"}


def test_an_unregistered_mode_is_refused():
    assert "toy_reinforce" not in options.LOSS_TYPES and "toy_pg" not in options.LOSS_MODES
    with pytest.raises(OptionError, match="loss_type must be one of"):
        gk.GRPOOptions(loss_type="toy_reinforce")
