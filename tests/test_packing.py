"""grpo.packing: token-budget micro-batches, packed layouts, attention within each sequence, and
packed steps that equal padded ones (log-probs, loss normalisers, gradients).

The model checks run a tiny Qwen2 built in code (2 layers, hidden 64, vocab 301, random weights);
the reference is each sequence alone, unpadded, through a float64 copy of the model.
"""

from __future__ import annotations

import copy
import random
from types import SimpleNamespace

import pytest
import torch

from grpo import packing
from grpo_kernels import reference
from grpo_kernels.options import GRPOOptions

from helpers import assert_close64, tiny_causal_lm
from spec64 import grpo64

VOCAB = 301


# --------------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------------
def tiny_model(attn: str = "sdpa", gradient_checkpointing: bool = False, seed: int = 0):
    model = tiny_causal_lm("Qwen2", seed, attn=attn, vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                           tie_word_embeddings=False)
    model = model.float().train()  # dropout is 0: train mode changes nothing but checkpointing
    if gradient_checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    return model


def padded_batch(prompt_lens, completion_lens, seed: int = 0, loss_mask_drop: float = 0.0):
    """A left/right-padded batch (the trainer's UpdateBatch fields), with random pad ids (never read)."""
    g = torch.Generator().manual_seed(seed)
    B, P, T = len(prompt_lens), max(prompt_lens), max(max(completion_lens), 1)
    input_ids = torch.randint(0, VOCAB, (B, P + T), generator=g)
    attention_mask = torch.zeros(B, P + T, dtype=torch.long)
    for b, (p, c) in enumerate(zip(prompt_lens, completion_lens)):
        attention_mask[b, P - p : P + c] = 1
    loss_mask = attention_mask[:, P:].clone()
    if loss_mask_drop:
        loss_mask = loss_mask * (torch.rand(B, T, generator=g) >= loss_mask_drop)
    return SimpleNamespace(
        input_ids=input_ids, attention_mask=attention_mask, prompt_len=P, completion_ids=input_ids[:, P:],
        loss_mask=loss_mask, advantages=torch.randn(B, generator=g), old_logps=None, ref_logps=None,
    )


def random_lengths(rng: random.Random, B: int):
    return [rng.randint(1, 6) for _ in range(B)], [rng.randint(0, 9) for _ in range(B)]


def separate_logps64(model, batch) -> torch.Tensor:
    """[B, T] float64 completion log-probs, each sequence alone and unpadded through a float64 copy of ``model``."""
    m64 = copy.deepcopy(model).double().eval()
    m64.set_attn_implementation("eager")
    B, T = batch.completion_ids.shape
    out = torch.zeros(B, T, dtype=torch.float64)
    prompt_lens, completion_lens = packing.sequence_spans(batch.attention_mask, batch.prompt_len)
    for b in range(B):
        tokens = batch.input_ids[b][batch.attention_mask[b] != 0].unsqueeze(0)
        p, c = int(prompt_lens[b]), int(completion_lens[b])
        with torch.no_grad():
            logp = torch.log_softmax(m64(input_ids=tokens, use_cache=False).logits, -1)[0]
        for t in range(c):
            out[b, t] = logp[p - 1 + t, tokens[0, p + t]]
    return out


def packed_logps(model, mb: packing.PackedMicroBatch, **forward_kwargs) -> torch.Tensor:
    """[1, L] float32 log-probs of each position's target (0 where it predicts nothing)."""
    kwargs = packing.packed_forward_kwargs(model, mb.layout)
    kwargs.update(forward_kwargs)
    hidden = model.base_model(**kwargs).last_hidden_state
    targets = torch.where(mb.layout.is_target, mb.completion_ids, torch.full_like(mb.completion_ids, -100))
    return reference.fused_linear_token_logprobs(hidden, model.lm_head.weight, targets)


# --------------------------------------------------------------------------------------------------
# micro-batches by a token budget
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(6))
def test_plan_first_fit_decreasing(seed):
    rng = random.Random(seed)
    lengths = [rng.choice([1, 2, 5, 17, 40, 64, 100, 130]) for _ in range(rng.randint(1, 40))]
    budget = rng.choice([64, 100, 128])
    plan = packing.plan_micro_batches(lengths, budget)
    flat = [i for mb in plan for i in mb]
    assert sorted(flat) == list(range(len(lengths)))  # every sequence exactly once
    for mb in plan:
        load = sum(lengths[i] for i in mb)
        assert load <= budget or (len(mb) == 1 and lengths[mb[0]] > budget)  # oversize only alone
        assert [lengths[i] for i in mb] == sorted((lengths[i] for i in mb), reverse=True)
    # first fit, longest first: replaying in decreasing order, no sequence fitted an earlier micro-batch
    where = {i: k for k, mb in enumerate(plan) for i in mb}
    loads = [0] * len(plan)
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        k = where[i]
        assert all(loads[j] + lengths[i] > budget for j in range(k)), (i, k, loads)
        if loads[k] == 0:
            assert k == 0 or loads[k - 1] > 0  # micro-batches open in order
        loads[k] += lengths[i]


def test_plan_edge_cases():
    assert packing.plan_micro_batches([], 10) == []
    assert packing.plan_micro_batches([3, 9, 4], None) == [[1, 2, 0]]
    assert packing.plan_micro_batches(torch.tensor([5, 30, 5]), 10) == [[1], [0, 2]]
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="max_tokens_per_microbatch"):
            packing.plan_micro_batches([1, 2], bad)
    with pytest.raises(ValueError, match="lengths"):
        packing.plan_micro_batches([1, -2], 4)


# --------------------------------------------------------------------------------------------------
# packed layout, pack / unpack
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(4))
def test_pack_layout_and_round_trip(seed):
    rng = random.Random(seed)
    prompt_lens, completion_lens = random_lengths(rng, rng.randint(1, 7))
    batch = padded_batch(prompt_lens, completion_lens, seed=seed, loss_mask_drop=0.3)
    B, T = batch.completion_ids.shape
    budget = rng.choice([6, 11, 24])
    mbs = packing.pack_batch(batch, budget)
    assert sorted(int(b) for mb in mbs for b in mb.layout.rows) == list(range(B))
    real = torch.arange(T) < torch.tensor(completion_lens).unsqueeze(-1)  # real completion positions
    for mb in mbs:
        lay = mb.layout
        assert mb.num_tokens == sum(prompt_lens[b] + completion_lens[b] for b in lay.rows.tolist())
        assert mb.num_tokens <= budget or len(mb) == 1
        cu = lay.cu_seq_lens.tolist()
        for k, b in enumerate(lay.rows.tolist()):
            s, e = cu[k], cu[k + 1]
            assert torch.equal(lay.input_ids[0, s:e], batch.input_ids[b][batch.attention_mask[b] != 0])
            assert torch.equal(lay.position_ids[0, s:e], torch.arange(e - s))
            assert bool((lay.segment_ids[0, s:e] == k).all())
            # position i predicts token i+1 of the same sequence; the last predicts nothing
            targets = lay.is_target[0, s:e]
            assert not bool(targets[-1]) and int(targets.sum()) == completion_lens[b]
            assert torch.equal(mb.completion_ids[0, s:e - 1][targets[:-1]], lay.input_ids[0, s + 1:e][targets[:-1]])
            assert bool((mb.completion_ids[0, s:e][~targets] == -100).all())
            assert bool((mb.advantages[0, s:e][targets] == batch.advantages[b]).all())
        assert lay.max_length == max(cu[k + 1] - cu[k] for k in range(len(lay)))
    # round trips: [B, T] -> packed -> [B, T] keeps every real completion position, zeros the rest
    values = torch.randn(B, T, dtype=torch.float64)
    back = packing.unpack_values(mbs, [mb.layout.pack(values) for mb in mbs])
    assert torch.equal(back, torch.where(real, values, torch.zeros_like(values)))
    assert torch.equal(packing.unpack_values(mbs, [mb.loss_mask for mb in mbs]), batch.loss_mask)
    # and packed -> [B, T] -> packed is the identity on the target positions
    for mb in mbs:
        packed = torch.randn(1, mb.num_tokens)
        again = mb.layout.pack(mb.layout.unpack(packed))
        assert torch.equal(again, torch.where(mb.layout.is_target, packed, torch.zeros_like(packed)))


def test_filler_adds_nothing():
    batch = padded_batch([2, 3], [3, 1])
    batch.old_logps = torch.randn(batch.completion_ids.shape)
    filler = packing.filler_micro_batch(batch)
    assert len(filler) == 0 and filler.num_tokens == 1 and filler.sequences_in_loss == 0
    assert float(filler.loss_mask.sum()) == 0 and int(filler.completion_ids) == -100 and filler.old_logps.shape == (1, 1)
    out = torch.full(batch.completion_ids.shape, 7.0)
    assert torch.equal(filler.layout.unpack(torch.randn(1, 1), out), torch.full_like(out, 7.0))
    model = tiny_model()
    packing.use_packed_attention(model)
    with torch.no_grad():
        assert packing.packed_forward(model, filler.layout).shape == (1, 1, 64)
    empty = copy.copy(batch)  # a rank left with no rows (e.g. every group dropped) still gets fillers
    empty.input_ids, empty.completion_ids = batch.input_ids[:0], batch.completion_ids[:0]
    assert packing.filler_micro_batch(empty).layout.completion_shape == (0, batch.completion_ids.shape[1])


def test_pack_rejects_unpackable_batches():
    batch = padded_batch([2, 3], [3, 1])
    bad = copy.copy(batch)
    bad.attention_mask = batch.attention_mask.clone()
    bad.attention_mask[0, batch.prompt_len] = 0  # a hole at the start of a completion
    with pytest.raises(ValueError, match="right-padded"):
        packing.pack_batch(bad, 8)
    bad = copy.copy(batch)
    bad.loss_mask = torch.ones_like(batch.loss_mask)  # loss on padding
    with pytest.raises(ValueError, match="loss_mask"):
        packing.pack_batch(bad, 8)
    bad = copy.copy(batch)
    bad.attention_mask = batch.attention_mask.clone()
    bad.attention_mask[1, : batch.prompt_len] = 0  # a completion without a prompt token
    with pytest.raises(ValueError, match="no prompt token"):
        packing.pack_batch(bad, 8)
    lay = packing.pack_rows(batch.input_ids, batch.attention_mask, batch.prompt_len, [1])
    with pytest.raises(ValueError, match="values"):
        lay.pack(torch.zeros(3, 3))
    with pytest.raises(ValueError, match="rows"):
        packing.pack_rows(batch.input_ids, batch.attention_mask, batch.prompt_len, [0, 0])


# --------------------------------------------------------------------------------------------------
# attention within each sequence: packed log-probs equal each sequence alone
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("attn", ["packed_sdpa", "sdpa", "eager"])
def test_packed_logprobs_equal_separate_sequences(attn):
    batch = padded_batch([5, 1, 3, 4, 2], [7, 5, 0, 9, 3], seed=1)
    model = tiny_model()
    expected = separate_logps64(model, batch)
    if attn == "packed_sdpa":
        assert packing.use_packed_attention(model) == packing.PACKED_SDPA
    else:
        model.set_attn_implementation(attn)
    mbs = packing.pack_batch(batch, 24)
    assert max(len(mb) for mb in mbs) > 1  # sequences do share rows
    with torch.no_grad():
        got = packing.unpack_values(mbs, [packed_logps(model, mb) for mb in mbs])
    real = torch.arange(batch.completion_ids.shape[1]) < batch.attention_mask[:, batch.prompt_len:].sum(-1, keepdim=True)
    assert_close64(got, expected, scale=6.0, what=f"{attn} packed vs separate")
    assert bool((got[~real] == 0).all())

    # the check can fail: causal attention across the whole row (sequences see each other) is far off
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        leaky = [packed_logps(model, mb, position_ids=torch.arange(mb.num_tokens).unsqueeze(0)) for mb in mbs]
    assert float((packing.unpack_values(mbs, leaky) - expected).abs().max()) > 1e-3


def test_packed_sdpa_is_sdpa_without_packing_and_validates():
    """Given no cu_seq_lens (generation, padded batches) packed_sdpa is transformers' sdpa."""
    batch = padded_batch([3, 5], [4, 2], seed=2)
    model = tiny_model()
    position_ids = (batch.attention_mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        sdpa = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=position_ids).logits
        packing.use_packed_attention(model)
        packed_impl = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=position_ids).logits
    real = batch.attention_mask.bool()
    assert torch.equal(sdpa[real], packed_impl[real])
    # and generation (a cache, left-padded prompts) is unchanged
    model.eval()
    prompts, prompt_mask = batch.input_ids[:, : batch.prompt_len], batch.attention_mask[:, : batch.prompt_len]
    gen = dict(attention_mask=prompt_mask, max_new_tokens=5, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        packed_gen = model.generate(prompts, **gen)
        model.set_attn_implementation("sdpa")
        assert torch.equal(packed_gen, model.generate(prompts, **gen))
        packing.use_packed_attention(model)
    lay = packing.pack_batch(batch, None)[0].layout
    kwargs = packing.packed_forward_kwargs(model, lay)
    kwargs["cu_seq_lens_q"] = kwargs["cu_seq_lens_k"] = torch.tensor([0, 3], dtype=torch.int32)
    with pytest.raises(ValueError, match="cu_seq_lens_q ends at 3"):
        model.base_model(**kwargs)
    model.config._attn_implementation = "some_other"
    with pytest.raises(ValueError, match="attn_implementation"):
        packing.packed_forward_kwargs(model, lay)


def test_flash_attention_gets_varlen_kwargs():
    """flash_attention_2 / _3 get cu_seq_lens and max lengths (transformers' varlen path), no mask."""
    batch = padded_batch([3, 5, 2], [4, 2, 6], seed=5)
    lay = packing.pack_batch(batch, None)[0].layout
    model = tiny_model()
    model.config._attn_implementation = "flash_attention_2"  # (the kwargs only; the kernel needs a GPU)
    assert packing.use_packed_attention(model) == "flash_attention_2"
    kwargs = packing.packed_forward_kwargs(model, lay)
    assert "attention_mask" not in kwargs and kwargs["use_cache"] is False
    assert torch.equal(kwargs["cu_seq_lens_q"], torch.tensor([0, 8, 15, 22], dtype=torch.int32))
    assert lay.rows.tolist() == [2, 0, 1]  # longest first
    assert kwargs["max_length_q"] == kwargs["max_length_k"] == 8 and isinstance(kwargs["max_length_q"], int)
    assert torch.equal(kwargs["position_ids"], lay.position_ids)


@pytest.mark.gpu
def test_flash_attention_varlen_logprobs_equal_separate_sequences():
    pytest.importorskip("flash_attn")
    batch = padded_batch([5, 1, 3, 4, 2], [7, 5, 0, 9, 3], seed=1)
    model = tiny_model()
    expected = separate_logps64(model, batch)
    model = model.to("cuda", torch.bfloat16)
    model.set_attn_implementation("flash_attention_2")
    mbs = packing.pack_batch(batch, 24)
    for mb in mbs:
        mb.layout.input_ids, mb.layout.position_ids = mb.layout.input_ids.cuda(), mb.layout.position_ids.cuda()
        mb.layout.cu_seq_lens = mb.layout.cu_seq_lens.cuda()
    with torch.no_grad():
        got = []
        for mb in mbs:
            hidden = packing.packed_forward(model, mb.layout).float()
            targets = torch.where(mb.layout.is_target, mb.completion_ids, torch.full_like(mb.completion_ids, -100)).cuda()
            got.append(reference.fused_linear_token_logprobs(hidden, model.lm_head.weight.float(), targets).cpu())
    assert_close64(packing.unpack_values(mbs, got), expected, dtype=torch.bfloat16, scale=6.0, what="flash varlen")


# --------------------------------------------------------------------------------------------------
# a packed step equals the padded one: loss and gradients, every reduction
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("loss_type, gradient_checkpointing", [
    ("dapo", False), ("grpo", False), ("dr_grpo", False), ("grpo", True),
])
def test_packed_step_gradients_equal_padded(loss_type, gradient_checkpointing):
    """Sum of packed micro-batch losses == sum of padded micro-batch losses (the trainer's scaling),
    and so are the gradients of every model parameter; the padded side runs in float64."""
    batch = padded_batch([4, 2, 6, 1, 3, 5], [8, 3, 0, 6, 9, 2], seed=3, loss_mask_drop=0.2)
    g = torch.Generator().manual_seed(4)
    B, T = batch.completion_ids.shape
    batch.advantages = torch.tensor([1.0, -0.5, 0.7, -1.2, 0.9, 0.4])
    # off-policy, near the current log-probs (about -log 301): ratios on both sides of the clip range
    batch.old_logps = (-5.7 + 0.5 * torch.randn(B, T, generator=g)) * batch.loss_mask
    options = GRPOOptions(loss_type=loss_type, max_completion_length=T + 3, eps_high=0.28)
    num_items = batch.loss_mask.sum().float().clamp(min=1.0)

    # padded, float64 (tests/spec64.py), two rows per micro-batch, scaled as the trainer's policy_loss does
    model = tiny_model()
    m64 = copy.deepcopy(model).double()
    P = batch.prompt_len
    padded_loss = 0.0
    for start in range(0, B, 2):
        rows = slice(start, start + 2)
        am = batch.attention_mask[rows]
        out = m64.base_model(input_ids=batch.input_ids[rows], attention_mask=am,
                             position_ids=(am.cumsum(-1) - 1).clamp(min=0), use_cache=False)
        loss = grpo64(
            m64.lm_head(out.last_hidden_state[:, P - 1 : -1]), batch.completion_ids[rows],
            batch.advantages[rows], batch.loss_mask[rows], old_logps=batch.old_logps[rows],
            loss_type=loss_type, max_completion_length=options.max_completion_length, eps_high=0.28,
            num_items_in_batch=num_items,
        )[0] * (1.0 if loss_type == "dapo" else 2 / B)
        loss.backward()
        padded_loss += float(loss.detach())

    # packed, float32, budget 16 tokens per micro-batch (the 10-token sequence alone is under it)
    if gradient_checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    packing.use_packed_attention(model)
    mbs = packing.pack_batch(batch, 16)
    assert len(mbs) > 1 and max(len(mb) for mb in mbs) > 1
    packed_loss = 0.0
    for mb in mbs:
        hidden = packing.packed_forward(model, mb.layout)
        # the loss API's own packed reduction (segment_ids), as the trainer calls it
        loss = reference.fused_linear_grpo_loss(
            hidden, model.lm_head.weight, mb.completion_ids, mb.advantages, mb.loss_mask, old_logps=mb.old_logps,
            segment_ids=mb.segment_ids, loss_type=loss_type, max_completion_length=options.max_completion_length,
            eps_high=0.28, num_items_in_batch=num_items,
        ).loss
        loss = loss * (1.0 if loss_type == "dapo" else mb.sequences_in_loss / B)  # (the trainer's loss_normalisation)
        loss.backward()
        packed_loss += float(loss.detach())

    assert abs(packed_loss - padded_loss) <= 1e-5 * max(1.0, abs(padded_loss))
    grads = {n: p.grad for n, p in model.named_parameters()}
    for name, p64 in m64.named_parameters():
        expected = p64.grad if p64.grad is not None else torch.zeros_like(p64)
        got = grads[name] if grads[name] is not None else torch.zeros_like(p64, dtype=torch.float32)
        scale = max(float(expected.abs().max()), 1e-12)
        assert_close64(got, expected, scale=scale, what=f"{loss_type} grad of {name}")
    assert float(m64.lm_head.weight.grad.abs().max()) > 0  # the comparison is not between zeros
