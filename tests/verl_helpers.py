"""Helpers of tests/test_integrations_verl.py that run in processes of their own.

- ``reference64``: verl's kernel's outputs and gradients in float64 on the whole vocabulary (the
  statement in ``grpo_kernels/integrations/verl.py``), with a -100 label's log-prob 0.
- ``tp_worker``: one process of a 3-process gloo world; its groups of 2 and of 3 ranks (uneven
  vocabulary shards) run ``linear_cross_entropy(..., dist_process_group=group)`` and check it against
  ``reference64``. It imports neither verl nor the test module (a spawned rank starts in seconds, not
  in ten), and one spawn serves both group sizes.
- ``engine_step``: one step of verl's own actor update (its FSDP2 engine, one gloo rank, this CPU)
  with verl's "torch" fused backend and then its "triton" one after our ``patch()``; run as a script
  in a fresh process (``python tests/verl_helpers.py engine OUT_JSON``) because it selects verl's
  platform and initialises torch.distributed for the whole process.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import sys
import tempfile
import traceback
from typing import Dict, Optional, Sequence, Tuple

import torch

IGNORE = -100
TP_SHARDS = {2: (23, 14), 3: (9, 20, 8)}  # uneven contiguous vocabulary shards, rank order
TP_H = 20
TP_TIMEOUT_S = 90


# ---------------------------------------------------------------------------- float64 reference
def reference64(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, temperature,
                reduction: str, coef_logp: torch.Tensor, coef_entropy: torch.Tensor):
    """(log_probs, entropy, d hidden, d weight, d logits) in float64 of ``L = sum(coef_logp * log_probs)
    + sum(coef_entropy * entropy)`` (``coef_logp`` a scalar for "sum"/"mean"), computed directly:
    ``z = h W^T / T``, ``p = softmax(z)``, ``d log p_t / d z = onehot_t - p``,
    ``d H / d z = -p (z - sum p z)``; chain rule ``d z / d h = W / T``. ``temperature``: a number or
    one per row (``N`` values)."""
    h = hidden.detach().double().reshape(-1, hidden.shape[-1])
    w = weight.detach().double()
    lab = labels.reshape(-1)
    n = h.shape[0]
    if isinstance(temperature, torch.Tensor):
        temperature = temperature.detach().double().reshape(n, 1)
    z = h @ w.T / temperature
    logp_all = torch.log_softmax(z, -1)
    p = logp_all.exp()
    ignored = lab == IGNORE
    safe = torch.where(ignored, torch.zeros_like(lab), lab).long()
    token_logp = torch.where(ignored, torch.zeros(n, dtype=torch.float64), logp_all.gather(1, safe[:, None])[:, 0])
    entropy = -(p * logp_all).sum(-1)
    if reduction == "none":
        log_probs, g_logp = token_logp, coef_logp.double().reshape(-1)
    elif reduction == "sum":
        log_probs, g_logp = token_logp.sum(), coef_logp.double().expand(n)
    else:
        log_probs, g_logp = token_logp.sum() / max(n, 1), coef_logp.double().expand(n) / max(n, 1)
    g_logp = torch.where(ignored, torch.zeros_like(g_logp), g_logp)
    onehot = torch.nn.functional.one_hot(safe, w.shape[0]).double()
    mean_z = (p * z).sum(-1, keepdim=True)
    d_z = g_logp[:, None] * (onehot - p) + coef_entropy.double().reshape(-1)[:, None] * (-p * (z - mean_z))
    d_logits = d_z / temperature
    d_hidden = (d_logits @ w).reshape(hidden.shape)
    d_weight = d_logits.T @ h
    return log_probs, entropy, d_hidden, d_weight, d_logits


def abs_scale(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest ``(|a| @ |b|)`` entry: what the rounding error of a product ``a @ b`` is relative to
    (each term's error is relative to the term, and the terms may cancel), at least 1e-3."""
    return max(float((a.abs() @ b.abs()).max()), 1e-3)


# ---------------------------------------------------------------------------- tensor-parallel ranks
def _tp_case(seed: int, world: int, shape: Tuple[int, ...], label_shape: Tuple[int, ...], reduction: str,
             temperature: float, dtype: torch.dtype):
    """The same full-vocabulary problem on every rank (seeded); this rank's shard is sliced by the caller."""
    g = torch.Generator().manual_seed(seed)
    vocab = sum(TP_SHARDS[world])
    hidden = (torch.randn(*shape, TP_H, generator=g) * 0.7).to(dtype)
    weight = torch.randn(vocab, TP_H, generator=g).to(dtype)
    n = hidden.numel() // TP_H
    labels = torch.randint(0, vocab, (n,), generator=g)
    labels[1] = IGNORE
    labels[n // 2] = vocab - 1  # the last shard's last id
    labels = labels.reshape(label_shape)
    coef_logp = torch.randn(() if reduction != "none" else (n,), generator=g)
    coef_entropy = torch.randn(n, generator=g)
    return hidden, weight, labels, coef_logp, coef_entropy


TP_CASES = (  # (layout, hidden's leading shape, labels' shape, reduction, temperature, dtype)
    ("hf", (2, 9), (2, 9), "none", 0.7, torch.float32),
    ("megatron", (13, 1), (1, 13), "none", 1.0, torch.float32),  # [S, 1, H] with labels [1, S]
    ("packed", (1, 11), (1, 11), "sum", 1.3, torch.float32),  # N = 11: not a multiple of 16
    ("hf", (3, 5), (3, 5), "mean", 0.9, torch.float32),
    ("hf", (2, 6), (2, 6), "none", 0.8, torch.bfloat16),
)


TP_PROCESSES = max(TP_SHARDS)  # one gloo world; the smaller group is its first ranks


def tp_worker(rank: int, store_path: str) -> None:
    """One process of a gloo world of ``TP_PROCESSES``: for each group size in ``TP_SHARDS`` (the first
    ranks of the world, so that one spawn serves both), ``_tp_group_checks`` on the ranks in it."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, TP_PROCESSES), rank=rank,
                            world_size=TP_PROCESSES, timeout=datetime.timedelta(seconds=TP_TIMEOUT_S))
    try:
        for world in sorted(TP_SHARDS):
            group = dist.new_group(list(range(world)))  # every process takes part in creating it
            if rank < world:
                _tp_group_checks(rank, world, group)
            dist.barrier()
    except BaseException:
        traceback.print_exc()
        dist.destroy_process_group()
        raise
    # Passed: leave as tests/helpers.leave_gloo_worker does (barrier, destroy, no interpreter teardown,
    # whose C++ static destructors once aborted a passing gloo rank under load), without importing it here.
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _tp_group_checks(rank: int, world: int, group) -> None:
    """Every TP_CASES case against ``reference64``, bitwise-equal outputs on all ranks, verl's
    hidden-gradient convention (this rank's partial sum), then bad input on one rank only."""
    import torch.distributed as dist

    from grpo_kernels.integrations.verl import linear_cross_entropy

    from helpers import assert_close64

    sizes = TP_SHARDS[world]
    lo = sum(sizes[:rank])
    shard = slice(lo, lo + sizes[rank])
    for i, (layout, shape, label_shape, reduction, temperature, dtype) in enumerate(TP_CASES):
        what = f"rank {rank}/{world} {layout} {reduction} {dtype}"
        hidden, weight, labels, c_logp, c_ent = _tp_case(100 + i, world, shape, label_shape, reduction,
                                                         temperature, dtype)
        h = hidden.clone().requires_grad_(True)
        w = weight[shard].clone().requires_grad_(True)
        log_probs, entropy = linear_cross_entropy(h, w, labels, temperature, reduction, group)
        assert log_probs.dtype == entropy.dtype == torch.float32
        n = hidden.numel() // TP_H
        assert entropy.shape == (n,) and log_probs.shape == ((n,) if reduction == "none" else ())
        (log_probs * c_logp).sum().add((entropy * c_ent).sum()).backward()
        ref_lp, ref_ent, _, ref_dw, ref_dlogits = reference64(hidden, weight, labels, temperature, reduction,
                                                              c_logp, c_ent)
        # tolerances of the inputs' dtype: the logits are rounded to it once (bf16: ~1e-2 relative)
        assert_close64(log_probs, ref_lp, dtype=dtype, scale=max(1.0, float(ref_lp.abs().max())),
                       what=f"{what} log_probs")
        assert_close64(entropy, ref_ent, dtype=dtype, scale=4, what=f"{what} entropy")
        # d weight: this shard's slice of the unsharded gradient
        assert w.grad.dtype == dtype and h.grad.dtype == dtype
        h64, w64 = hidden.double().reshape(-1, TP_H), weight[shard].double()
        assert_close64(w.grad, ref_dw[shard], dtype=dtype, scale=abs_scale(ref_dlogits[:, shard].T, h64),
                       what=f"{what} d weight")
        # d hidden: verl's convention, d logits[:, shard] @ W_shard, not all-reduced
        partial = (ref_dlogits[:, shard] @ w64).reshape(hidden.shape)
        assert_close64(h.grad, partial, dtype=dtype, scale=abs_scale(ref_dlogits[:, shard], w64),
                       what=f"{what} d hidden (this rank's partial sum)")
        # every rank holds the same outputs, bit for bit; the partial d hidden sum to the full one
        both = torch.cat([log_probs.detach().reshape(-1), entropy.detach()])
        gathered = [torch.empty_like(both) for _ in range(world)]
        dist.all_gather(gathered, both, group=group)
        assert all(torch.equal(x, gathered[0]) for x in gathered), f"{what}: ranks disagree"
        total = h.grad.double().clone()
        dist.all_reduce(total, group=group)
        full = reference64(hidden, weight, labels, temperature, reduction, c_logp, c_ent)[2]
        assert_close64(total, full, dtype=dtype, scale=world * abs_scale(ref_dlogits, weight.double()),
                       what=f"{what} sum of d hidden over ranks")
    # bad input on one rank only: the same ValueError on every rank, no hang; the group still works
    hidden, weight, labels, _, _ = _tp_case(7, world, (2, 4), (2, 4), "none", 1.0, torch.float32)
    bad = labels.clone()
    if rank == world - 1:
        bad[0, 0] = sum(sizes)  # one past the last shard
    try:
        linear_cross_entropy(hidden, weight[shard], bad, 1.0, "none", group)
    except ValueError as error:
        assert "labels" in str(error) or "refused on rank" in str(error), str(error)
    else:
        raise AssertionError(f"rank {rank}: an out-of-vocabulary label was not refused")
    # the last rank without a vocabulary shard, or with another hidden size: refused on every rank
    for what, (h_bad, w_bad) in {"an empty shard": (hidden, weight[shard][:0]),
                                 "another hidden size": (hidden[..., :-1], weight[shard][:, :-1])}.items():
        if rank != world - 1:
            h_bad, w_bad = hidden, weight[shard]
        try:
            linear_cross_entropy(h_bad, w_bad, labels, 1.0, "none", group)
        except ValueError as error:
            assert any(word in str(error) for word in ("weight", "refused on rank", "differ")), str(error)
        else:
            raise AssertionError(f"rank {rank}: {what} on rank {world - 1} was not refused")
    out, _ = linear_cross_entropy(hidden, weight[shard], labels, 1.0, "none", group)
    assert torch.isfinite(out).all()


# ---------------------------------------------------------------------------- verl's engine on this CPU
def register_cpu_platform():
    """A CPU platform for verl 0.9 (``verl.plugin.platform``, its registry for new hardware): verl
    detects only NVIDIA, Ascend and AMD devices and otherwise falls back to "cuda", so its FSDP engine
    cannot start on a CPU without one. Set before verl's engine modules are imported (they read the
    device name at import)."""
    from verl.plugin.platform.platform_base import PlatformBase
    from verl.plugin.platform.platform_manager import PlatformRegistry, set_platform

    @PlatformRegistry.register(platform="cpu")
    class PlatformCPU(PlatformBase):
        device_name = "cpu"
        vendor_name = "cpu"
        device_module = torch.cpu

        def is_available(self): return True
        def is_platform_available(self, use_smi_check=False): return True
        def current_device(self): return "cpu"  # ``.to(get_device_id())`` must give the CPU
        def device_count(self): return 1
        def set_device(self, device_index): pass
        def synchronize(self, device_index=None): pass
        def manual_seed(self, seed): torch.manual_seed(seed)
        def manual_seed_all(self, seed): torch.manual_seed(seed)
        def set_allocator_settings(self, settings): pass
        def empty_cache(self): pass
        def get_device_capability(self, device_index=0): return None, None
        def communication_backend_name(self): return "gloo"
        def visible_devices_envvar(self): return "CUDA_VISIBLE_DEVICES"

        @contextlib.contextmanager
        def nvtx_range(self, msg):
            yield

        def profiler_start(self): pass
        def profiler_stop(self): pass
        def ray_resource_name(self): return "CPU"
        def ray_noset_envvars(self): return []
        def is_ipc_supported(self): return False
        def cudart(self): return None

    set_platform(PlatformCPU())


def _engine_batch(vocab: int):
    """verl's own batch layout: a DataProto with left/right padding -> its no-padding TensorDict."""
    from verl import DataProto
    from verl.utils import tensordict_utils as tu
    from verl.utils.model import compute_position_id_with_mask
    from verl.workers.utils.padding import left_right_2_no_padding

    g = torch.Generator().manual_seed(1)
    b, s, r = 4, 12, 6
    input_ids = torch.randint(0, vocab, (b, s), generator=g)
    attention_mask = torch.ones(b, s, dtype=torch.long)
    attention_mask[0, :3] = 0  # left padding of a prompt
    attention_mask[1, -2:] = 0  # right padding of a response
    data = DataProto.from_single_dict({
        "input_ids": input_ids, "prompts": input_ids[:, :-r], "attention_mask": attention_mask,
        "position_ids": compute_position_id_with_mask(attention_mask), "responses": input_ids[:, -r:],
        "response_mask": attention_mask[:, -r:], "advantages": torch.randn(b, r, generator=g),
        "old_log_probs": -torch.rand(b, r, generator=g) * 4,
    })
    td = left_right_2_no_padding(data.to_tensordict())
    tu.assign_non_tensor(td, global_batch_size=b, use_remove_padding=True, use_dynamic_bsz=False,
                         micro_batch_size_per_gpu=2, max_token_len_per_gpu=1024, use_fused_kernels=True,
                         calculate_entropy=True, temperature=0.7)
    return td


def _one_step(model_path: str, backend: str) -> Dict[str, object]:
    """verl's FSDP2 engine built from ``model_path`` with ``use_fused_kernels`` and ``impl_backend``;
    one ``train_batch`` (verl's ppo_loss with an entropy bonus); the gradients and the step's outputs."""
    from functools import partial

    from verl.workers.config import ActorConfig, FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead
    from verl.workers.utils.losses import ppo_loss

    model_config = HFModelConfig(path=model_path, load_tokenizer=False, use_remove_padding=True,
                                 use_fused_kernels=True, fused_kernel_options={"impl_backend": backend},
                                 override_config={"attn_implementation": "eager"},
                                 enable_gradient_checkpointing=False)
    model_config.model_type = "language_model"
    engine_config = FSDPEngineConfig(forward_only=False, fsdp_size=1, strategy="fsdp2", use_dynamic_bsz=False,
                                     micro_batch_size_per_gpu=2, use_torch_compile=False,
                                     mixed_precision={"param_dtype": "fp32", "reduce_dtype": "fp32",
                                                      "buffer_dtype": "fp32"})
    engine = FSDPEngineWithLMHead(model_config=model_config, engine_config=engine_config,
                                  optimizer_config=FSDPOptimizerConfig(lr=1e-3), checkpoint_config=None)
    engine.initialize()
    actor_config = ActorConfig(strategy="fsdp2", rollout_n=1, ppo_micro_batch_size_per_gpu=2, ppo_mini_batch_size=4,
                               use_dynamic_bsz=False, entropy_coeff=0.05)
    before = {n: p.detach().full_tensor().clone() for n, p in engine.module.named_parameters()}
    with engine.train_mode():  # which zeroes the gradients on leaving: read them inside
        out = engine.train_batch(_engine_batch(model_config.hf_config.vocab_size),
                                 loss_function=partial(ppo_loss, config=actor_config))
        grads = {name: p.grad.full_tensor().tolist() for name, p in engine.module.named_parameters()}
    moved = {name: float((p.detach().full_tensor() - before[name]).abs().max())
             for name, p in engine.module.named_parameters()}
    return {"grads": grads, "moved": moved, "grad_norm": float(out["metrics"]["grad_norm"])}


def engine_step(out_json: str) -> None:
    """Both backends in one fresh process (VERL_USE_EXTERNAL_PLUGINS=none: nothing patches verl until
    this calls ``patch()``); writes what the test compares."""
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        from helpers import tiny_causal_lm

        # tied embeddings: verl 0.9.1's FSDP2 wraps an untied lm_head as a unit of its own, and its fused
        # forwards then read lm_head.weight outside that unit's forward, still sharded (a DTensor), which
        # its own "torch" backend refuses too
        tiny_causal_lm("Qwen2", 0, vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                       tie_word_embeddings=True).save_pretrained(tmp)
        dist.init_process_group("gloo", store=dist.FileStore(os.path.join(tmp, "store"), 1), rank=0, world_size=1)
        try:
            register_cpu_platform()
            import grpo_kernels.integrations.verl as gk_verl

            result: Dict[str, object] = {"patched_at_start": gk_verl.is_patched()}
            result["torch"] = _one_step(tmp, "torch")
            calls = []
            real = gk_verl.fused_linear_token_logprobs

            def counting(*args, **kwargs):
                calls.append(tuple(args[0].shape))
                return real(*args, **kwargs)

            gk_verl.fused_linear_token_logprobs = counting
            gk_verl.patch()
            result["triton"] = _one_step(tmp, "triton")
            result["calls"] = calls
        finally:
            dist.destroy_process_group()
    with open(out_json, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":  # python tests/verl_helpers.py engine OUT_JSON
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    if sys.argv[1] == "engine":
        engine_step(sys.argv[2])
