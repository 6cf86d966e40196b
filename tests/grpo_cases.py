"""A covering matrix of GRPO options and random batches to run it on, shared by the loss tests."""

from __future__ import annotations

import torch

B, T, V = 4, 7, 53


def make_batch(seed: int, dtype=torch.float32, empty_row: bool = True, B: int = B, T: int = T, V: int = V):
    """(logits, ids, mask, old, ref, adv, adv_tok, is_ratio) with old/ref near the current log-probs."""
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(B, T, V, generator=g) * 2).to(dtype)
    ids = torch.randint(0, V, (B, T), generator=g)
    mask = (torch.rand(B, T, generator=g) > 0.25).float()
    if empty_row and B > 1:
        mask[1] = 0  # a sequence with no completion tokens
    logp_now = torch.log_softmax(logits.double(), -1).gather(-1, ids[..., None])[..., 0]
    # old/ref log-probs near the current ones, so ratios land on both sides of the clip range
    old = (logp_now + 0.4 * torch.randn(B, T, generator=g, dtype=torch.float64)).float()
    ref = (logp_now + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)).float()
    adv = torch.randn(B, generator=g)
    adv_tok = torch.randn(B, T, generator=g)
    is_ratio = torch.rand(B, T, generator=g) + 0.5
    return logits, ids, mask, old, ref, adv, adv_tok, is_ratio


OPTION_CASES = {
    "on_policy": dict(),
    "old": dict(use_old=True),
    "old_ref_beta": dict(use_old=True, use_ref=True, beta=0.04),
    "ref_beta0_kl_metric": dict(use_ref=True),
    "asym_delta": dict(use_old=True, eps_low=0.2, eps_high=0.28, delta=1.5),
    "is_ratio": dict(use_old=True, use_is=True),
    "is_ratio_per_sequence": dict(use_old=True, use_is="column", use_ref=True, beta=0.02),
    "entropy_coef": dict(use_old=True, entropy_coef=0.01),
    "per_token_adv": dict(use_old=True, adv_per_token=True),
    "gspo": dict(use_old=True, importance_sampling_level="sequence"),
    "gspo_on_policy_beta": dict(use_ref=True, beta=0.1, importance_sampling_level="sequence"),
    "temperature": dict(use_old=True, temperature=0.7),
}


def build_kwargs(case: dict, batch):
    logits, ids, mask, old, ref, adv, adv_tok, is_ratio = batch
    kw = {k: v for k, v in case.items() if k not in ("use_old", "use_ref", "use_is", "adv_per_token")}
    if case.get("use_old"):
        kw["old_logps"] = old
    if case.get("use_ref"):
        kw["ref_logps"] = ref
    if case.get("use_is"):
        kw["is_ratio"] = is_ratio[:, :1] if case["use_is"] == "column" else is_ratio
    advantages = adv_tok if case.get("adv_per_token") else adv
    return advantages, kw
