"""``grpo.activations``: checkpointed layer inputs in host memory, each decoder MLP over token chunks.

- offload: gradients bitwise those of the checkpointed run without it (Qwen2, Qwen3, Llama built in
  code), every layer's input copied out once and back once (twice for a second backward), the host
  bytes the plan counts; on a CPU the trainer attaches nothing and logs one INFO line.
- MLP chunks: gradients against a float64 reference for Qwen2/3, Llama and Gemma, with and without
  checkpointing and offload; LoRA adapters inside the MLP, their dropout masks replayed in the backward;
  bf16 autocast replayed in the backward; the packed ``[1, L, H]`` layout through the trainer; only the
  MLP's input saved; state-dict names unchanged; bad sizes refused.
- 2 ranks under torchrun (gloo): DDP and FSDP2 with both options, against one process without them.
"""

from __future__ import annotations

import copy
import logging
import os
import sys

import pytest
import torch

from helpers import assert_close64, tiny_causal_lm, tiny_config, torchrun

from grpo import activations

pytestmark = pytest.mark.timeout(300)

SHAPE = dict(vocab_size=48, hidden_size=32, intermediate_size=80, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, max_position_embeddings=128)
FAMILIES = ("qwen2", "qwen3", "llama", "gemma")


def tiny(family: str, dtype: torch.dtype = torch.float32, checkpointing: bool = False, seed: int = 0):
    """A ``family``-shaped causal LM with seeded random weights, built in code, in training mode."""
    names = {"qwen2": "Qwen2", "qwen3": "Qwen3", "llama": "Llama", "gemma": "Gemma"}[family]
    model = tiny_causal_lm(names, seed, attn="sdpa", **SHAPE).to(dtype).train()
    if checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    return model


def gradients(model, ids: torch.Tensor, seed: int = 1, backwards: int = 1) -> dict[str, torch.Tensor]:
    """The gradients of a random projection of the last hidden states (fresh weights per ``seed``)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    hidden = base.model(input_ids=ids, use_cache=False).last_hidden_state
    w = torch.randn(hidden.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(hidden.dtype)
    loss = (hidden * w).sum()
    for i in range(backwards):
        loss.backward(retain_graph=i < backwards - 1)
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def ids_for(seed: int = 0, shape=(2, 37)) -> torch.Tensor:
    return torch.randint(0, SHAPE["vocab_size"], shape, generator=torch.Generator().manual_seed(seed))


def assert_grads_close64(got: dict, expected: dict, what: str) -> None:
    assert got.keys() == expected.keys() and expected, what
    for name, e in expected.items():
        assert_close64(got[name], e, torch.float32, scale=float(e.abs().max()), what=f"{what} {name}")


# ------------------------------------------------------------------------------ offload
@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama"])
def test_offload_gives_bitwise_gradients_and_moves_every_layer_input(family):
    ids = ids_for()
    expected = gradients(tiny(family, checkpointing=True), ids)
    model = tiny(family, checkpointing=True)
    offload = activations.ActivationOffload("cpu")
    assert offload.attach(model) >= SHAPE["num_hidden_layers"]
    got = gradients(model, ids)
    assert got.keys() == expected.keys()
    assert all(torch.equal(got[k], expected[k]) for k in expected)
    L, (B, T), H = SHAPE["num_hidden_layers"], ids.shape, SHAPE["hidden_size"]
    assert offload.copies_out == offload.copies_in == L  # one input a layer, each back once (prefetched or not)
    assert offload.peak_host_bytes == L * B * T * H * 4  # the plan's host term, L x N x H x b
    assert offload.host_bytes == 0  # released with the graph


def test_offload_survives_a_second_backward_and_a_deep_copy():
    ids = ids_for()
    expected = gradients(tiny("qwen2", checkpointing=True), ids, backwards=2)
    model = tiny("qwen2", checkpointing=True)
    offload = activations.ActivationOffload("cpu")
    offload.attach(model)
    assert copy.deepcopy(model).model.layers[0]._gradient_checkpointing_func.offload is offload
    offload.attach(model)  # again: replaces, does not nest
    assert not isinstance(model.model.layers[0]._gradient_checkpointing_func.checkpoint_fn, type(
        model.model.layers[0]._gradient_checkpointing_func))
    got = gradients(model, ids, backwards=2)
    assert all(torch.equal(got[k], expected[k]) for k in expected)
    assert offload.copies_in == 2 * offload.copies_out == 2 * SHAPE["num_hidden_layers"]


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_offload_on_cuda_gives_bitwise_gradients_with_pinned_copies_on_a_side_stream(family):
    """The CUDA path (pinned buffers, the side stream, events, one layer prefetched): bitwise gradients,
    the device's peak lower by the layers' inputs, every copy through pinned memory."""
    ids = ids_for().cuda()

    def run(offload: bool):
        model = tiny(family, torch.bfloat16, checkpointing=True).cuda()
        hooks = activations.offload_checkpointed_inputs(model, torch.device("cuda")) if offload else None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        grads = gradients(model, ids)
        torch.cuda.synchronize()
        return grads, torch.cuda.max_memory_allocated(), hooks

    expected, _, _ = run(False)
    got, _, hooks = run(True)
    assert all(torch.equal(got[k], expected[k]) for k in expected)
    assert hooks.copies_out == hooks.copies_in == SHAPE["num_hidden_layers"] and hooks.host_bytes == 0
    assert hooks.peak_host_bytes == SHAPE["num_hidden_layers"] * ids.numel() * SHAPE["hidden_size"] * 2


def test_offload_needs_checkpointing():
    with pytest.raises(ValueError, match="activation_offload.*gradient checkpointing"):
        activations.ActivationOffload("cpu").attach(tiny("qwen2"))
    from grpo.config import GRPOConfig

    with pytest.raises(ValueError, match="GRPOConfig.activation_offload.*GRPOConfig.gradient_checkpointing"):
        GRPOConfig(activation_offload=True, gradient_checkpointing=False)
    with pytest.raises(TypeError, match=r"GRPOConfig.activation_offload must be a bool \(True or False\)"):
        GRPOConfig(activation_offload="yes", gradient_checkpointing=True)


def test_offload_on_a_cpu_is_a_no_op_with_one_info_line(tmp_path, caplog):
    from grpo.models import prepare_model

    cfg = tiny_config(tmp_path, gradient_checkpointing=True, activation_offload=True)
    model = tiny("qwen2")
    with caplog.at_level(logging.INFO, logger="grpo.activations"):
        prepare_model(model, cfg, torch.device("cpu"))
    lines = [r for r in caplog.records if r.name == "grpo.activations"]
    assert len(lines) == 1 and lines[0].levelno == logging.INFO and "no-op" in lines[0].getMessage()
    assert not any(isinstance(m.__dict__.get("_gradient_checkpointing_func"), activations._OffloadedCheckpoint)
                   for m in model.modules())


# ------------------------------------------------------------------------------ MLP chunks
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("checkpointing", [False, True])
def test_chunked_mlp_gradients_match_float64(family, checkpointing):
    ids = ids_for()
    expected = gradients(tiny(family, torch.float64), ids)
    model = tiny(family, checkpointing=checkpointing)
    assert activations.chunk_mlps(model, 5) == SHAPE["num_hidden_layers"]  # 74 tokens: 14 chunks of 5, one of 4
    offload = activations.ActivationOffload("cpu")
    if checkpointing:
        offload.attach(model)  # both options together
    got = gradients(model, ids)
    assert_grads_close64(got, expected, f"{family} chunked")
    assert offload.copies_out == (SHAPE["num_hidden_layers"] if checkpointing else 0)


def test_chunked_mlp_saves_only_its_input():
    model = tiny("qwen2")
    mlp = model.model.layers[0].mlp
    activations.chunk_mlps(model, 8)
    x = torch.randn(1, 40, SHAPE["hidden_size"], requires_grad=True)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = mlp(x)
    activations_saved = [t for t in saved if t.untyped_storage().data_ptr() not in params]
    assert len(activations_saved) == 1 and activations_saved[0].untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
    assert y.shape == x.shape
    with torch.no_grad():  # (a plain loop without gradients)
        torch.testing.assert_close(mlp(x), type(mlp).forward(mlp, x), rtol=1e-6, atol=1e-6)


def test_chunked_mlp_keeps_names_is_idempotent_and_refuses_bad_sizes():
    model = tiny("qwen2")
    names = list(model.state_dict())
    assert activations.chunk_mlps(model, 4) == activations.chunk_mlps(model, 6) == SHAPE["num_hidden_layers"]
    assert list(model.state_dict()) == names and model.model.layers[1].mlp.mlp_chunk_tokens == 6
    twin = copy.deepcopy(model)
    assert twin.model.layers[0].mlp.forward.__self__ is twin.model.layers[0].mlp  # bound to the copy
    for bad, error in ((0, ValueError), (-3, ValueError), (2.5, TypeError), (True, TypeError), ("8", TypeError)):
        with pytest.raises(error, match="mlp_chunk_tokens"):
            activations.chunk_mlps(model, bad)
    with pytest.raises(ValueError, match="mlp_chunk_tokens.*no decoder layer"):
        activations.chunk_mlps(torch.nn.Linear(2, 2), 4)


@pytest.mark.parametrize("fused", [False, True], ids=["peft-dropout", "fused-dropout"])
def test_chunked_mlp_covers_lora_and_replays_its_dropout(fused):
    """LoRA on every linear (peft's, and the trainer's with the dropout fused into lora_A,
    ``grpo.lora.fuse_dropout``): with dropout 0 the chunked gradients match the unchunked model's in
    float64; with dropout 0.3 they match plain autograd (peft's dropout: through the same chunks drawn
    from the same seed, so the backward's recompute drew the forward's masks; the fused dropout: the
    whole MLP at once, its masks the same whatever the chunks)."""
    pytest.importorskip("peft")
    from peft import LoraConfig, get_peft_model

    from grpo import lora as adapters

    def lora(dtype, dropout, chunk=None):
        model = get_peft_model(tiny("qwen2", dtype), LoraConfig(r=4, lora_dropout=dropout, target_modules="all-linear",
                                                                  init_lora_weights=False), autocast_adapter_dtype=False)
        if fused:
            adapters.fuse_dropout(model)
            assert dropout == 0 or any(isinstance(m, adapters.DropoutLinear) for m in model.modules())
        if chunk:
            activations.chunk_mlps(model, chunk)
        return model.train()

    ids = ids_for()
    expected = gradients(lora(torch.float64, 0.0), ids)
    got = gradients(lora(torch.float32, 0.0, chunk=6), ids)
    assert any("mlp.down_proj.lora_A" in k for k in got)
    assert_grads_close64(got, expected, "lora chunked")

    x = torch.randn(1, 29, SHAPE["hidden_size"], dtype=torch.float64, requires_grad=True)
    dy = torch.randn(1, 29, SHAPE["hidden_size"], dtype=torch.float64)

    def mlp_grads(chunked: bool):
        model = lora(torch.float64, 0.3)
        mlp = model.get_base_model().model.layers[0].mlp
        params = [p for p in mlp.parameters() if p.requires_grad]
        torch.manual_seed(7)
        if chunked:
            activations.chunk_mlps(model, 6)
            y = mlp(x)
        elif fused:  # the fused dropout's masks do not depend on the chunking: the whole MLP at once
            y = type(mlp).forward(mlp, x)
        else:  # peft's dropout draws chunk by chunk: plain autograd over the same chunks, in the same order
            y = torch.cat([type(mlp).forward(mlp, x[:, i:i + 6]) for i in range(0, 29, 6)], dim=1)
        return [y.detach()] + list(torch.autograd.grad(y, [x] + params, dy))

    for got, want in zip(mlp_grads(True), mlp_grads(False)):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert not torch.equal(mlp_grads(True)[0], lora_plain_output(lora, x))  # (the dropout did drop something)


def lora_plain_output(build, x):
    model = build(torch.float64, 0.3).eval()  # dropout off
    mlp = model.get_base_model().model.layers[0].mlp
    with torch.no_grad():
        return type(mlp).forward(mlp, x)


def test_chunked_mlp_replays_autocast_in_its_backward():
    """Under CPU bf16 autocast every run of the MLP's projections, the backward's per-chunk recompute
    included, computes in bf16 as the forward did; the gradients stay within bf16 rounding of fp32's."""
    ids = ids_for()
    model = tiny("qwen2")
    activations.chunk_mlps(model, 5)
    dtypes = []
    model.model.layers[0].mlp.gate_proj.register_forward_hook(lambda m, i, o: dtypes.append((torch.is_grad_enabled(), o.dtype)))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = gradients(model, ids)
    assert {grad for grad, _ in dtypes} == {False, True}  # the forward's chunks and the backward's
    assert {dtype for _, dtype in dtypes} == {torch.bfloat16}
    expected = gradients(tiny("qwen2", torch.float64), ids)
    for name, e in expected.items():
        assert_close64(got[name], e, torch.bfloat16, scale=float(e.abs().max()), what=name)


def test_chunked_mlp_in_the_trainer_with_packing(tmp_path):
    """One trainer update (packed ``[1, L, H]`` rows, gradient checkpointing) with MLP chunks that cut
    across sequences: the gradients of the update without them, to fp32 rounding."""
    from grpo.models import prepare_model
    from grpo.trainer import make_optimizer, update

    batch = update_batch()
    grads = {}
    for chunk in (None, 5):
        cfg = tiny_config(tmp_path, gradient_checkpointing=True, padding_free=True, mlp_chunk_tokens=chunk, beta=0.0)
        policy = prepare_model(tiny("qwen3"), cfg, torch.device("cpu"))
        assert getattr(policy.model.model.layers[0].mlp, "mlp_chunk_tokens", None) == chunk
        update(policy, make_optimizer(policy, cfg), batch, cfg, torch.device("cpu"))
        grads[chunk] = {n: p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None}
    assert_grads_close64(grads[5], grads[None], "packed trainer update")  # (fp32 both: rounding only)


def update_batch():
    """6 rollouts of a 4-token prompt (left-padded) and 0..7 completion tokens, an off-policy ratio."""
    from grpo.trainer import UpdateBatch

    g = torch.Generator().manual_seed(0)
    B, P, T, V = 6, 4, 7, SHAPE["vocab_size"]
    prompt_len = torch.randint(1, P + 1, (B,), generator=g)
    prompt_mask = (torch.arange(P) >= P - prompt_len[:, None]).long()
    completion_len = torch.randint(1, T + 1, (B,), generator=g)
    loss_mask = (torch.arange(T) < completion_len[:, None]).long()
    completion_ids = torch.randint(2, V, (B, T), generator=g) * loss_mask
    input_ids = torch.cat([torch.randint(2, V, (B, P), generator=g) * prompt_mask, completion_ids], 1)
    old = (-3.0 + 0.3 * torch.randn(B, T, generator=g)) * loss_mask
    return UpdateBatch(input_ids=input_ids, attention_mask=torch.cat([prompt_mask, loss_mask], 1), prompt_len=P,
                       completion_ids=completion_ids, loss_mask=loss_mask, advantages=torch.randn(B, generator=g),
                       old_logps=old)


# ------------------------------------------------------------------------------ 2 ranks (gloo)
DISTRIBUTED_CASES = [("ddp", False), ("fsdp", False), ("ddp", True)]  # (kind, LoRA)


def distributed_update(kind: str, use_peft: bool, options: bool, tmp: str, rows=None):
    """One update on ``rows`` of the batch (all of it in one process): gradients, full and keyed by name."""
    from grpo import lora
    from grpo.models import prepare_model
    from grpo.trainer import make_optimizer, update

    extra = dict(gradient_checkpointing=True, mlp_chunk_tokens=3) if options else {}
    cfg = tiny_config(__import__("pathlib").Path(tmp), distributed=kind, padding_free=True, use_peft=use_peft, lora_r=4,
                      lora_dropout=0.0, beta=0.0, **extra)
    model = tiny("qwen2", seed=0)
    if use_peft:
        torch.manual_seed(1)
        model = lora.add_adapters(model, cfg)
    policy = prepare_model(model, cfg, torch.device("cpu"))
    offload = activations.ActivationOffload("cpu")
    if options:
        from grpo.models import unwrap

        offload.attach(unwrap(policy))  # (the trainer attaches none on a CPU: the mechanism itself here)
    batch = update_batch()
    update(policy, make_optimizer(policy, cfg), batch if rows is None else batch.rows(rows), cfg, torch.device("cpu"))
    grads = {}
    for name, p in policy.named_parameters():
        if p.grad is not None:
            g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            grads[name.removeprefix("module.").removeprefix("model.")] = g.detach().clone()
    return grads, offload.copies_out


def worker(out: str) -> None:
    from grpo import distributed

    distributed.setup("ddp")
    rank, results = distributed.rank(), {}
    for kind, use_peft in DISTRIBUTED_CASES:
        rows = torch.arange(0, 3) if rank == 0 else torch.arange(3, 6)
        results[kind, use_peft] = distributed_update(kind, use_peft, True, os.path.dirname(out), rows)
    if rank == 0:
        torch.save(results, out)


def test_both_options_on_two_ranks_match_one_process_without_them(tmp_path):
    out = tmp_path / "grads.pt"
    torchrun([__file__, str(out)], timeout=240)
    results = torch.load(out, weights_only=False)
    torch.set_num_threads(1)
    for (kind, use_peft), (grads, copies) in results.items():
        expected, _ = distributed_update("none", use_peft, False, str(tmp_path))
        assert copies == SHAPE["num_hidden_layers"] * 1, (kind, use_peft, copies)  # one packed row a rank
        assert_grads_close64(grads, expected, f"{kind} lora={use_peft}")


if __name__ == "__main__":  # a worker, started by torchrun
    torch.set_num_threads(1)
    worker(sys.argv[1])


# --------------------------------------------------------------------------------------------------
# fused_norm: the decoder's RMSNorms through grpo_kernels.rms_norm
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
def test_fused_norms_gradients_match_float64(family):
    """Every RMSNorm swapped (Qwen3's per-head q_norm / k_norm included), state-dict names unchanged,
    gradients (the norms' weights included) within fp32 rounding of the unswapped model's in float64."""
    ids = ids_for()
    expected = gradients(tiny(family, torch.float64), ids)
    model = tiny(family, checkpointing=True)
    names = list(model.state_dict())
    per_layer = 4 if family == "qwen3" else 2
    count = per_layer * SHAPE["num_hidden_layers"] + 1
    assert activations.fuse_norms(model, "torch") == activations.fuse_norms(model) == count  # (again: "auto")
    assert list(model.state_dict()) == names
    got = gradients(model, ids)
    assert any("norm" in name for name in got)
    assert_grads_close64(got, expected, f"{family} fused norms")


def _norm_classes():
    import importlib

    found = []
    for name, (gemma, eps_name) in activations.RMSNORM_CLASSES.items():
        family = {"Qwen2Moe": "qwen2_moe", "Qwen3Moe": "qwen3_moe", "Qwen3Next": "qwen3_next",
                  "SmolLM3": "smollm3"}.get(name[:-len("RMSNorm")], name[:-len("RMSNorm")].lower())
        try:
            module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
        except ImportError:
            continue
        found.append(getattr(module, name))
    return found


@pytest.mark.parametrize("cls", _norm_classes(), ids=lambda c: c.__name__)
def test_each_known_norm_class_computes_what_its_own_forward_does(cls):
    """The table's promise, class by class: the swapped forward gives the class's own values and gradients
    (bf16 input and weight: within bf16 rounding; the weight away from its initial value)."""
    norm = cls(24, eps=1e-5).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.add_(torch.randn(24) * 0.3)
    x = torch.randn(3, 5, 24).to(torch.bfloat16)
    dy = torch.randn(3, 5, 24).to(torch.bfloat16)

    def run(module):
        xi = x.clone().requires_grad_(True)
        y = module(xi)
        gx, gw = torch.autograd.grad(y, [xi, module.weight], dy)
        return y, gx, gw

    want = run(norm)
    twin = copy.deepcopy(norm)
    assert activations.fuse_norms(twin) == 1
    for got, expect in zip(run(twin), want):
        assert got.dtype == expect.dtype
        torch.testing.assert_close(got.float(), expect.float(), rtol=2e-2, atol=5e-2)


def test_fused_norms_leave_an_unknown_model_with_one_info_line(caplog):
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    with caplog.at_level(logging.INFO, logger="grpo.activations"):
        assert activations.fuse_norms(model) == 0
    assert [r.levelname for r in caplog.records] == ["INFO"] and "LayerNorm" in caplog.text


@pytest.mark.parametrize("on", [True, False])
def test_prepare_model_fuses_norms_when_asked(tmp_path, on):
    from grpo.models import prepare_model, unwrap

    from helpers import tiny_config

    policy = prepare_model(tiny("qwen3"), tiny_config(tmp_path, fused_norm=on), torch.device("cpu"))
    norm = unwrap(policy).model.layers[0].self_attn.q_norm
    assert ("forward" in norm.__dict__) == on
    assert getattr(norm, "fused_norm_backend", None) == ("torch" if on else None)  # (the run's backend="torch")
    with pytest.raises(ValueError, match="backend"):
        activations.fuse_norms(tiny("qwen2"), "cuda")


# --------------------------------------------------------------------------------------------------
# the memory options never change the numbers
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_memory_options_keep_lora_dropout_losses_and_gradients(family):
    """The trainer's adapters (grpo.lora.add_adapters, lora_dropout 0.3 on every linear) under gradient
    checkpointing: with mlp_chunk_tokens (chunks of 5 of 74 tokens) and the offload attached too, the
    same seed gives the same masks, so the loss and every gradient equal the run without them to fp32
    rounding (peft's own dropout, drawn chunk by chunk from torch's generator, differed by tens of percent)."""
    pytest.importorskip("peft")
    from grpo import lora
    from grpo.config import GRPOConfig

    cfg = GRPOConfig(output_dir="unused", use_peft=True, lora_r=4, lora_alpha=8, lora_dropout=0.3)

    def run(options: bool):
        model = tiny(family, checkpointing=True)
        torch.manual_seed(3)
        model = lora.add_adapters(model, cfg)
        with torch.no_grad():  # (B away from 0, so the adapters and their masks reach the output)
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))))
        offload = activations.ActivationOffload("cpu")
        if options:
            activations.chunk_mlps(model, 5)
            offload.attach(model)
        model.train()
        torch.manual_seed(11)
        base = model.get_base_model()
        hidden = base.model(input_ids=ids_for(), use_cache=False).last_hidden_state
        w = torch.randn(hidden.shape, generator=torch.Generator().manual_seed(1))
        loss = (hidden * w).sum()
        loss.backward()
        assert offload.copies_out == (SHAPE["num_hidden_layers"] if options else 0)
        return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    (loss0, grads0), (loss1, grads1) = run(False), run(True)
    assert any("mlp.down_proj.lora_A" in n for n in grads0) and grads0.keys() == grads1.keys()
    torch.testing.assert_close(loss1, loss0, rtol=1e-5, atol=1e-5)
    for name, g in grads0.items():
        torch.testing.assert_close(grads1[name], g, rtol=1e-5, atol=1e-6 * float(g.abs().max()), msg=name)
