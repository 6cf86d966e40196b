"""grpo_kernels.integrations.openrlhf against OpenRLHF's own ``Actor`` (``make test-openrlhf``: its venv).

OpenRLHF's code is the reference: a tiny Qwen2 (odd vocabulary, built in code, saved to a temporary
folder) is loaded by ``openrlhf.models.Actor`` exactly as OpenRLHF loads a checkpoint (SDPA or eager
attention on the CPU), and the same Actor runs OpenRLHF's own ``Actor.forward`` (kept aside before
``patch()``) and the patched one on the same batch: log-probs, entropies, and the gradient of every
trainable parameter of a PPO loss built with OpenRLHF's ``PolicyLoss`` and ``aggregate_loss`` (as its
``ppo_actor.py`` builds it, entropy bonus included). Both are also checked against float64
log-softmax / entropy of the model's own hidden states and head.
"""

from __future__ import annotations

import logging
import warnings

import pytest
import torch

openrlhf_actor = pytest.importorskip("openrlhf.models.actor", reason="OpenRLHF is not installed (make install-openrlhf)")

from helpers import assert_close64, tiny_causal_lm, tolerance  # noqa: E402
from openrlhf.models import Actor, PolicyLoss, aggregate_loss  # noqa: E402

from grpo_kernels.integrations import _host  # noqa: E402
from grpo_kernels.integrations import openrlhf as gk  # noqa: E402

VOCAB = 71  # odd on purpose
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
OPENRLHF_FORWARD = Actor.forward  # OpenRLHF's own, taken before any test patches


@pytest.fixture(autouse=True)
def unpatched():
    gk.unpatch()
    gk._warned.clear()
    yield
    gk.unpatch()


def save_tiny_qwen2(folder, tied: bool, seed: int = 0) -> str:
    model = tiny_causal_lm("Qwen2", seed, vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                           tie_word_embeddings=tied, pad_token_id=0, eos_token_id=1, bos_token_id=None)
    with torch.no_grad():  # peaked, varied distributions: log-probs far from uniform, entropies spread
        model.get_output_embeddings().weight.mul_(6.0)
    model.save_pretrained(folder)
    return str(folder)


def make_actor(path: str, dtype: str, attn: str = "sdpa", packing: bool = False, temperature: float = 1.0,
               **kwargs) -> Actor:
    """OpenRLHF's Actor, loaded from ``path`` as OpenRLHF loads a checkpoint (fp32: loaded in bf16 by
    OpenRLHF's param_dtype table, which has no fp32, then cast: the same weights as a bf16 load)."""
    actor = Actor(path, attn_implementation=attn, param_dtype="bf16", packing_samples=packing,
                  temperature=temperature, **kwargs)
    return actor.to(DTYPES[dtype])


def ppo_batch(seed: int = 0, b: int = 3, s: int = 14, a: int = 6):
    """An OpenRLHF experience: left-padded prompts, right-padded responses (sequences [B, S]), the
    attention mask, the action mask [B, A] of the response tokens, old log-probs and advantages."""
    g = torch.Generator().manual_seed(seed)
    sequences = torch.randint(2, VOCAB, (b, s), generator=g)
    attention_mask = torch.ones(b, s, dtype=torch.long)
    action_mask = torch.ones(b, a, dtype=torch.bool)
    for row, (left, right) in enumerate([(0, 0), (3, 2), (1, 4)][:b]):
        attention_mask[row, :left] = 0
        sequences[row, :left] = 0
        if right:
            attention_mask[row, s - right:] = 0
            sequences[row, s - right:] = 0
            action_mask[row, a - right:] = False
    old = -torch.rand(b, a, generator=g) * 4
    advantages = torch.randn(b, a, generator=g)
    return sequences, attention_mask, action_mask, old, advantages


def ppo_step(forward, actor: Actor, batch, entropy_coef: float = 0.01):
    """OpenRLHF's ppo_actor training forward and loss (policy loss, entropy bonus); -> (action
    log-probs, entropy [B, S-1], {parameter name: gradient})."""
    sequences, attention_mask, action_mask, old, advantages = batch
    actor.zero_grad(set_to_none=True)
    log_probs, output = forward(actor, sequences, action_mask, attention_mask=attention_mask, return_output=True,
                                return_entropy=True)
    loss = PolicyLoss(clip_eps_low=0.2, clip_eps_high=0.28)(log_probs, old, advantages, action_mask=action_mask)[0]
    loss = loss - entropy_coef * aggregate_loss(output.entropy[:, -action_mask.shape[1]:], action_mask)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in actor.named_parameters() if p.requires_grad}
    return log_probs.detach(), output.entropy.detach(), grads


def patched_forward(actor, *args, **kwargs):
    return actor(*args, **kwargs)


def hidden_and_head(actor: Actor, sequences, attention_mask):
    """The model's last hidden states (OpenRLHF's position ids) and head, for a float64 reference."""
    lm = gk._causal_lm(actor.model)
    position_ids = attention_mask.long().cumsum(-1) - 1
    position_ids.masked_fill_(attention_mask == 0, 1)
    with torch.no_grad():
        hidden = lm.base_model(sequences, attention_mask=attention_mask, position_ids=position_ids).last_hidden_state
        logits = lm.get_output_embeddings()(hidden)  # in the model's dtype, as OpenRLHF's logits
    return logits.double()


def reference64(actor: Actor, batch, temperature: float):
    """float64 log-softmax / entropy of the model's own logits (rounded to its dtype, as OpenRLHF's)."""
    sequences, attention_mask, action_mask, _, _ = batch
    z = hidden_and_head(actor, sequences, attention_mask)[:, :-1] / temperature
    logp = torch.log_softmax(z, -1)
    log_probs = logp.gather(-1, sequences[:, 1:, None])[..., 0]
    entropy = -(logp.exp() * logp).sum(-1)
    a = action_mask.shape[1]
    return log_probs[:, -a:] * action_mask, entropy


def grad_scale(grads) -> dict:
    return {n: max(g.double().abs().max().item(), 1e-30) for n, g in grads.items()}


CASES = [  # (dtype, tied, packing, temperature, attention)
    ("fp32", False, False, 1.0, "sdpa"),
    ("fp32", True, False, 0.7, "eager"),
    ("fp32", False, True, 0.7, "sdpa"),
    ("bf16", False, False, 0.7, "sdpa"),
    ("bf16", True, True, 1.0, "eager"),
]


@pytest.mark.parametrize("dtype,tied,packing,temperature,attn", CASES)
def test_ppo_step_matches_openrlhf(tmp_path, dtype, tied, packing, temperature, attn):
    path = save_tiny_qwen2(tmp_path, tied)
    actor = make_actor(path, dtype, attn, packing, temperature)
    batch = ppo_batch()
    action_mask = batch[2]
    want_lp, want_ent, want_grads = ppo_step(OPENRLHF_FORWARD, actor, batch)
    gk.patch()
    head = gk._causal_lm(actor.model).get_output_embeddings()
    calls = []
    hook = head.register_forward_hook(lambda *a: calls.append(1))
    try:
        got_lp, got_ent, got_grads = ppo_step(patched_forward, actor, batch)
    finally:
        hook.remove()
    assert not calls, "the patched forward ran lm_head (the [B, S, V] logits)"
    torch_dtype = DTYPES[dtype]
    # against OpenRLHF's own forward (the same rounding of the logits, fp32 reduction order apart)
    assert_close64(got_lp, want_lp.double(), torch.float32, scale=4.0, what="action log-probs vs OpenRLHF")
    # OpenRLHF's padding positions hold the entropy of the padded rows (unpacked) or 0 (packed): compare all
    assert_close64(got_ent, want_ent.double(), torch.float32, scale=4.0, what="entropy vs OpenRLHF")
    assert set(got_grads) == set(want_grads)
    scales = grad_scale(want_grads)
    for name, g in got_grads.items():
        # bf16: OpenRLHF's backward rounds d logits to bf16 before its matmuls, ours keeps fp32 per chunk
        assert_close64(g, want_grads[name].double(), torch_dtype if torch_dtype != torch.float32 else torch.float32,
                       scale=scales[name], what=f"d {name}")
    # both against float64 (the logits rounded to the model's dtype, as both round them)
    ref_lp, ref_ent = reference64(actor, batch, temperature)
    assert_close64(got_lp, ref_lp, torch.float32, scale=4.0, what="action log-probs vs float64")
    valid = batch[1][:, :-1].bool()
    assert_close64(got_ent[valid], ref_ent[valid], torch.float32, scale=4.0, what="entropy vs float64")
    assert bool(torch.isfinite(got_lp).all()) and bool((got_lp[~action_mask] == 0).all())


@pytest.mark.parametrize("packing", [False, True])
def test_return_logprobs_without_action_mask(tmp_path, packing):
    """SFT / DPO's call: ``return_logprobs=True``, every predicted position [B, S-1]."""
    actor = make_actor(save_tiny_qwen2(tmp_path, tied=False), "fp32", packing=packing, temperature=0.9)
    sequences, attention_mask, *_ = ppo_batch(seed=1)
    want, want_out = OPENRLHF_FORWARD(actor, sequences, attention_mask=attention_mask, return_logprobs=True,
                                      return_output=True)
    gk.patch()
    got, out = actor(sequences, attention_mask=attention_mask, return_logprobs=True, return_output=True)
    only = actor(sequences, attention_mask=attention_mask, return_logprobs=True)
    assert got.shape == (sequences.shape[0], sequences.shape[1] - 1)
    assert_close64(got, want.double(), torch.float32, scale=4.0, what="log-probs [B, S-1]")
    assert torch.equal(only, got)
    assert "logits" not in out and not hasattr(out, "entropy")
    assert "logits" in want_out


def test_lora_gradients_match(tmp_path):
    """LoRA through peft (OpenRLHF's lora_rank / target_modules): the adapters' gradients agree."""
    actor = make_actor(save_tiny_qwen2(tmp_path, tied=False), "fp32", lora_rank=4, lora_alpha=8,
                       target_modules=["q_proj", "v_proj", "down_proj"])
    with torch.no_grad():  # peft starts B at 0: give the adapters a value so their path matters
        for name, p in actor.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    batch = ppo_batch(seed=2)
    want_lp, want_ent, want_grads = ppo_step(OPENRLHF_FORWARD, actor, batch)
    gk.patch()
    got_lp, got_ent, got_grads = ppo_step(patched_forward, actor, batch)
    assert any("lora_A" in n for n in got_grads) and set(got_grads) == set(want_grads)
    assert_close64(got_lp, want_lp.double(), torch.float32, scale=4.0, what="log-probs")
    assert_close64(got_ent, want_ent.double(), torch.float32, scale=4.0, what="entropy")
    scales = grad_scale(want_grads)
    for name, g in got_grads.items():
        assert_close64(g, want_grads[name].double(), torch.float32, scale=scales[name], what=f"d {name}")


def test_adapter_on_lm_head_falls_back_with_one_warning(tmp_path):
    actor = make_actor(save_tiny_qwen2(tmp_path, tied=False), "fp32", lora_rank=4,
                       target_modules=["q_proj", "lm_head"])
    batch = ppo_batch(seed=3)
    want = OPENRLHF_FORWARD(actor, batch[0], batch[2], attention_mask=batch[1])
    gk.patch()
    with pytest.warns(UserWarning, match="PEFT adapter wraps lm_head"):
        got = actor(batch[0], batch[2], attention_mask=batch[1])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per reason
        again = actor(batch[0], batch[2], attention_mask=batch[1])
    assert torch.equal(got, want) and torch.equal(again, want)


def test_logits_call_goes_to_openrlhf(tmp_path):
    """``return_output`` alone asks for the logits: OpenRLHF's forward serves it, silently."""
    actor = make_actor(save_tiny_qwen2(tmp_path, tied=True), "fp32")
    sequences, attention_mask, *_ = ppo_batch(seed=4)
    gk.patch()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = actor(sequences, attention_mask=attention_mask, return_output=True)
    assert out["logits"].shape == (*sequences.shape, VOCAB) and out["logits"].dtype == torch.float32


def test_patch_unpatch_is_patched():
    assert not gk.is_patched()
    gk.unpatch()  # without patch: a no-op
    assert Actor.forward is OPENRLHF_FORWARD
    gk.patch()
    first = Actor.forward
    assert gk.is_patched() and first is not OPENRLHF_FORWARD
    gk.patch()  # twice: still one layer over OpenRLHF's own forward
    assert gk.is_patched() and gk._openrlhf_forward is OPENRLHF_FORWARD
    gk.unpatch()
    assert not gk.is_patched() and Actor.forward is OPENRLHF_FORWARD
    with pytest.raises(ValueError, match="backend"):
        gk.patch(backend="cuda")
    with pytest.raises(ValueError, match="chunk_size"):
        gk.patch(chunk_size=0)
    assert not gk.is_patched()


@pytest.mark.parametrize("call,match", [
    (lambda a, s, m, am: a(s[0], am, attention_mask=m), "sequences must be a 2-D"),
    (lambda a, s, m, am: a(s.float(), am, attention_mask=m), "sequences must be a 2-D"),
    (lambda a, s, m, am: a(s, am, attention_mask=m[:, :-1]), "attention_mask must have"),
    (lambda a, s, m, am: a(s, am[:2], attention_mask=m), "action_mask must be"),
    (lambda a, s, m, am: a(s, torch.ones(3, 14, dtype=torch.bool), attention_mask=m), "action_mask must be"),
    (lambda a, s, m, am: a(s, am, attention_mask=m, return_entropy=True), "return_entropy=True needs return_output"),
    (lambda a, s, m, am: a(s, am, attention_mask=m, return_output="yes"), "return_output"),
])
def test_bad_input_fails_by_name_before_the_model_runs(tmp_path, call, match):
    actor = make_actor(save_tiny_qwen2(tmp_path, tied=False), "fp32")
    sequences, attention_mask, action_mask, *_ = ppo_batch()
    gk.patch()
    ran = []
    hook = actor.model.register_forward_pre_hook(lambda *a: ran.append(1))
    base_hook = gk._causal_lm(actor.model).base_model.register_forward_pre_hook(lambda *a: ran.append(1))
    try:
        with pytest.raises((ValueError, TypeError), match=match):
            call(actor, sequences, attention_mask, action_mask)
    finally:
        hook.remove()
        base_hook.remove()
    assert not ran


def test_host_checks(monkeypatch, caplog):
    """patch() refuses an Actor.forward it was not written for, naming OpenRLHF's version and the
    piece; an untested release that passes the checks is patched with one INFO record."""
    version = _host.installed_version("openrlhf")

    def other_forward(self, sequences, action_mask=None, attention_mask=None, return_output=False):
        raise AssertionError("never called")

    monkeypatch.setattr(Actor, "forward", other_forward)
    with pytest.raises(_host.HostMismatchError, match=rf"openrlhf {version}: Actor.forward has the parameters"):
        gk.patch()
    assert Actor.forward is other_forward and not gk.is_patched()
    monkeypatch.setattr(Actor, "forward", OPENRLHF_FORWARD)
    monkeypatch.delattr(openrlhf_actor, "gather_and_pad_tensor")
    with pytest.raises(_host.HostMismatchError, match="has no gather_and_pad_tensor"):
        gk.patch()
    monkeypatch.undo()
    monkeypatch.setitem(_host.TESTED, "openrlhf", ("0.0.1",))
    with caplog.at_level(logging.INFO, logger="grpo_kernels.integrations.openrlhf"):
        gk.patch()
    assert gk.is_patched()
    assert any("not a release this integration was tested against" in r.getMessage() for r in caplog.records)


def test_tested_version_is_installed():
    """make test-openrlhf runs these tests on a release the tested table lists."""
    assert _host.is_tested("openrlhf", _host.installed_version("openrlhf")), _host.installed_version("openrlhf")


def test_moe_router_logits_fall_back_with_one_warning(tmp_path):
    """OpenRLHF turns on a MoE model's router logits (its aux_loss): the causal LM's own head serves."""
    model = tiny_causal_lm("Qwen2Moe", 0, vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
                           moe_intermediate_size=16, shared_expert_intermediate_size=16, num_experts=4,
                           num_experts_per_tok=2, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                           max_position_embeddings=64, pad_token_id=0)
    model.save_pretrained(tmp_path)
    actor = make_actor(str(tmp_path), "fp32")
    assert actor.model.config.output_router_logits
    batch = ppo_batch(seed=6)
    want, want_out = OPENRLHF_FORWARD(actor, batch[0], batch[2], attention_mask=batch[1], return_output=True)
    gk.patch()
    with pytest.warns(UserWarning, match="MoE router logits"):
        got, out = actor(batch[0], batch[2], attention_mask=batch[1], return_output=True)
    assert torch.equal(got, want) and torch.equal(out.aux_loss, want_out.aux_loss)
