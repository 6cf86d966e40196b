"""grpo_kernels.integrations.verl against verl 0.9.1 itself (no mocks): run in the venv that has verl,
``.venv-verl`` (``make test`` builds it and runs this file there; elsewhere it is skipped).

- ``linear_cross_entropy`` against a float64 statement of verl's kernel (values and gradients, every
  reduction, HF / packed / Megatron layouts, -100 labels, fp32 and bf16), and verl's signature.
- Bad input: a ValueError/TypeError naming verl's argument, before our kernel is called.
- ``patch`` / ``unpatch`` / ``is_patched``, the ``verl.plugins`` entry point (verl imported here with
  plugins on, so ``import verl`` patched it), verl's Megatron forwards' module-level copies, and verl's
  Megatron loss head (``fused_output_processor``) with megatron-core's parallel state on one gloo rank.
- verl's own HF forwards (tiny Qwen2 and Llama built in code): ``patch_forward_with_backends(model,
  use_fused_kernels=True, fused_kernels_backend="triton")`` after our patch gives verl's "torch"
  backend's log-probs, entropies and parameter gradients, and runs our code (counted).
- Tensor parallelism: groups of 2 and 3 gloo ranks with uneven vocabulary shards through
  ``dist_process_group`` (tests/verl_helpers.py ``tp_worker``, one spawn of 3 processes).
- One step of verl's own actor update: its FSDP2 engine on one gloo rank of this CPU, verl's
  ``ppo_loss`` with an entropy bonus, "torch" backend vs "triton" + our patch (a fresh process,
  started when this module starts, so that it overlaps the tests above).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
import json
import logging
import os
import re
import subprocess
import sys
import time

import pytest
import torch
import torch.multiprocessing as mp

verl = pytest.importorskip("verl")  # with plugins on (the default), this import runs our patch()

import grpo_kernels.integrations.verl as gk_verl  # noqa: E402
from helpers import assert_close64, tiny_causal_lm  # noqa: E402
from verl_helpers import IGNORE, TP_PROCESSES, TP_TIMEOUT_S, abs_scale, reference64, tp_worker  # noqa: E402

PATCHED_BY_IMPORTING_VERL = gk_verl.is_patched()
PLUGINS_ON = os.environ.get("VERL_USE_EXTERNAL_PLUGINS", "auto").strip().lower() != "none"
HERE = os.path.dirname(os.path.abspath(__file__))
ENGINE_TIMEOUT_S = 420

from verl.utils.kernel import linear_cross_entropy as verl_kernel_module  # noqa: E402


def is_verls(fn) -> bool:
    """verl's kernel is ``LinearCrossEntropy.apply``, a method bound to verl's autograd Function."""
    return getattr(fn, "__self__", None) is verl_kernel_module.LinearCrossEntropy


# ---------------------------------------------------------------------------- fixtures
ENGINE_TEST, TP_TEST = "test_verl_fsdp_engine_actor_step", "test_tensor_parallel_uneven_shards"


@pytest.fixture(scope="module", autouse=True)
def background(request, tmp_path_factory):
    """The slow, separate-process cases, all started when this module starts so that they overlap the
    in-process tests (each test then waits for its own): verl's engine step in a fresh process
    (tests/verl_helpers.py ``engine_step``) and the gloo groups (``tp_worker``), when selected."""
    selected = {item.originalname for item in request.session.items}
    tmp = tmp_path_factory.mktemp("verl")
    started = {}
    if ENGINE_TEST in selected:
        out, log = str(tmp / "engine.json"), tmp / "engine.log"
        env = dict(os.environ, VERL_USE_EXTERNAL_PLUGINS="none", PYTHONPATH=os.pathsep.join(
            [os.path.dirname(HERE), HERE, os.environ.get("PYTHONPATH", "")]))
        with open(log, "w") as sink:  # a file, not a pipe nobody reads until the end
            started["engine"] = (subprocess.Popen(
                [sys.executable, "-W", "ignore", os.path.join(HERE, "verl_helpers.py"), "engine", out], env=env,
                stdout=sink, stderr=subprocess.STDOUT), out, log)
    if TP_TEST in selected:
        started["tp"] = mp.start_processes(tp_worker, args=(str(tmp / "store"),), nprocs=TP_PROCESSES, join=False,
                                           start_method="spawn")
    yield started
    for key, value in started.items():
        processes = [value[0]] if key == "engine" else value.processes
        for process in processes:
            alive = process.poll() is None if key == "engine" else process.is_alive()
            if alive:
                process.kill()
    if "engine" in started:
        started["engine"][0].wait()


@pytest.fixture
def patched():
    """Our patch in effect for the test; the state of the process restored after it."""
    was = gk_verl.is_patched()
    gk_verl.patch()
    yield
    (gk_verl.patch if was else gk_verl.unpatch)()


@pytest.fixture
def calls(monkeypatch):
    """The shapes of ``hidden`` that reached our fused-linear path (the real function runs)."""
    seen = []
    real = gk_verl.fused_linear_token_logprobs

    def counting(hidden, *args, **kwargs):
        seen.append(tuple(hidden.shape))
        return real(hidden, *args, **kwargs)

    monkeypatch.setattr(gk_verl, "fused_linear_token_logprobs", counting)
    return seen


# ---------------------------------------------------------------------------- the function
def test_signature_is_verls():
    ours = inspect.signature(gk_verl.linear_cross_entropy).parameters
    theirs = list(inspect.signature(verl_kernel_module.LinearCrossEntropy.forward).parameters.values())[1:]  # ctx
    assert [(p.name, p.default) for p in ours.values()] == [(p.name, p.default) for p in theirs]
    assert gk_verl.REDUCTIONS == ("none", "sum", "mean")
    from verl.utils.kernel import kernels

    for number, name in enumerate(gk_verl.REDUCTIONS):  # verl's enum, in verl's order
        assert kernels.get_entropy_reduction_enum_number(name) == number


CASES = [  # (leading shape of hidden, shape of labels, reduction, temperature, dtype)
    ((2, 7), (2, 7), "none", 0.7, torch.float32),  # HF [B, L, H]
    ((1, 11), (1, 11), "sum", 1.0, torch.float32),  # packed [1, nnz, H]; N not a multiple of 16
    ((13, 1), (1, 13), "none", 1.3, torch.float32),  # Megatron [S, 1, H] with labels [1, S]
    ((9,), (9,), "mean", 0.9, torch.float32),  # [N, H]
    ((3, 5), (3, 5), "none", 0.8, torch.bfloat16),
    ((2, 6), (12,), "mean", 1.0, torch.bfloat16),
]


@pytest.mark.parametrize("lead,label_shape,reduction,temperature,dtype", CASES)
def test_matches_float64(lead, label_shape, reduction, temperature, dtype, calls):
    g = torch.Generator().manual_seed(sum(lead) * 31 + len(reduction))
    h_size, vocab = 24, 41
    hidden = (torch.randn(*lead, h_size, generator=g) * 0.8).to(dtype).requires_grad_(True)
    weight = torch.randn(vocab, h_size, generator=g).to(dtype).requires_grad_(True)
    n = hidden.numel() // h_size
    labels = torch.randint(0, vocab, (n,), generator=g)
    labels[0], labels[n // 2] = IGNORE, vocab - 1
    labels = labels.reshape(label_shape)
    c_logp = torch.randn(() if reduction != "none" else (n,), generator=g)
    c_ent = torch.randn(n, generator=g)
    log_probs, entropy = gk_verl.linear_cross_entropy(hidden, weight, labels, temperature, reduction)
    assert calls == [tuple(hidden.shape)]
    assert log_probs.dtype == entropy.dtype == torch.float32
    assert entropy.shape == (n,) and log_probs.shape == ((n,) if reduction == "none" else ())
    (log_probs * c_logp).sum().add((entropy * c_ent).sum()).backward()
    ref_lp, ref_ent, ref_dh, ref_dw, ref_dz = reference64(hidden, weight, labels, temperature, reduction, c_logp, c_ent)
    tol = dtype  # the logits go through one rounding to the inputs' dtype
    assert_close64(log_probs, ref_lp, dtype=tol, scale=max(1.0, float(ref_lp.abs().max())), what="log_probs")
    assert_close64(entropy, ref_ent, dtype=tol, scale=4, what="entropy")
    assert hidden.grad.dtype == weight.grad.dtype == dtype
    h64, w64 = hidden.detach().double().reshape(n, h_size), weight.detach().double()
    assert_close64(hidden.grad, ref_dh, dtype=tol, scale=abs_scale(ref_dz, w64), what="d hidden")
    assert_close64(weight.grad, ref_dw, dtype=tol, scale=abs_scale(ref_dz.T, h64), what="d weight")
    if reduction == "none":
        assert log_probs[0].item() == 0.0  # the -100 label


def test_ignored_label_has_no_log_prob_gradient():
    """A -100 row: log-prob exactly 0, no gradient through it; its entropy is the row's own, with its gradient."""
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(4, 16, generator=g, requires_grad=True)
    weight = torch.randn(19, 16, generator=g)
    labels = torch.tensor([3, IGNORE, 18, IGNORE])
    log_probs, entropy = gk_verl.linear_cross_entropy(hidden, weight, labels)
    assert log_probs[1].item() == 0.0 and log_probs[3].item() == 0.0
    log_probs.sum().backward()
    assert torch.equal(hidden.grad[1], torch.zeros(16)) and torch.equal(hidden.grad[3], torch.zeros(16))
    assert hidden.grad[0].abs().sum() > 0
    ref_ent = reference64(hidden, weight, labels, 1.0, "none", torch.zeros(4), torch.zeros(4))[1]
    assert_close64(entropy, ref_ent, what="entropy of -100 rows too")
    hidden.grad = None
    gk_verl.linear_cross_entropy(hidden, weight, labels)[1][1].backward()
    assert hidden.grad[1].abs().sum() > 0


@pytest.mark.parametrize("per", ["token", "sequence"])
def test_tensor_temperature(per, calls):
    """verl PR #6110's per-token ``temperature_rmpad [N]``, or one per sequence ``[B]`` for ``hidden
    [B, L, H]``: handed to ``fused_linear_token_logprobs`` as its per-token / per-sequence temperature.
    Runs once that function takes tensor temperatures (API contract v4, the sampling issue)."""
    g = torch.Generator().manual_seed(21)
    b, l, h_size, vocab = 3, 4, 12, 17
    hidden = torch.randn(b, l, h_size, generator=g, requires_grad=True)
    weight = torch.randn(vocab, h_size, generator=g, requires_grad=True)
    labels = torch.randint(0, vocab, (b, l), generator=g)
    labels[1, 2] = IGNORE
    per_sequence = torch.rand(b, generator=g) + 0.5
    temperature = per_sequence if per == "sequence" else torch.rand(b * l, generator=g) + 0.5
    try:
        import grpo_kernels

        grpo_kernels.fused_linear_token_logprobs(hidden[:1, :1].detach(), weight.detach(), labels[:1, :1],
                                                 temperature=per_sequence[:1])
    except TypeError as error:
        pytest.skip(f"fused_linear_token_logprobs takes no tensor temperature yet: {error}")
    calls.clear()
    log_probs, entropy = gk_verl.linear_cross_entropy(hidden, weight, labels, temperature, "none")
    assert len(calls) == 1
    c_logp, c_ent = torch.randn(b * l, generator=g), torch.randn(b * l, generator=g)
    (log_probs * c_logp).sum().add((entropy * c_ent).sum()).backward()
    per_row = per_sequence.repeat_interleave(l) if per == "sequence" else temperature
    ref_lp, ref_ent, ref_dh, ref_dw, ref_dz = reference64(hidden, weight, labels, per_row, "none", c_logp, c_ent)
    assert_close64(log_probs, ref_lp, scale=float(ref_lp.abs().max()), what="log_probs")
    assert_close64(entropy, ref_ent, what="entropy")
    assert_close64(hidden.grad, ref_dh, scale=abs_scale(ref_dz, weight.detach().double()), what="d hidden")
    assert_close64(weight.grad, ref_dw, scale=abs_scale(ref_dz.T, hidden.detach().double().reshape(b * l, h_size)),
                   what="d weight")


def _bad(**change):
    g = torch.Generator().manual_seed(0)
    args = dict(hidden=torch.randn(2, 3, 8, generator=g), weight=torch.randn(11, 8, generator=g),
                labels=torch.randint(0, 11, (2, 3), generator=g), temperature=1.0, reduction="none",
                dist_process_group=None)
    args.update(change)
    return args


BAD = [
    (dict(labels=torch.rand(2, 3)), TypeError, "labels"),
    (dict(labels=torch.full((2, 3), 11)), ValueError, "labels"),
    (dict(labels=torch.full((2, 3), -1)), ValueError, "labels"),
    (dict(labels=torch.zeros(5, dtype=torch.long)), ValueError, "labels"),
    (dict(labels=[1, 2]), TypeError, "labels"),
    (dict(weight=torch.randn(11, 7)), ValueError, "weight"),
    (dict(weight=torch.randn(11, 8, 1)), ValueError, "weight"),
    (dict(weight=torch.randn(0, 8)), ValueError, "weight"),
    (dict(hidden=torch.randint(0, 3, (2, 3, 8))), TypeError, "hidden"),
    (dict(reduction="avg"), ValueError, "reduction"),
    (dict(reduction=None), TypeError, "reduction"),
    (dict(temperature=0.0), ValueError, "temperature"),
    (dict(temperature=-1.0), ValueError, "temperature"),
    (dict(temperature=float("nan")), ValueError, "temperature"),
    (dict(temperature=True), TypeError, "temperature"),
    (dict(temperature="0.7"), TypeError, "temperature"),
    (dict(temperature=torch.ones(4)), ValueError, "temperature"),
    (dict(dist_process_group="tp"), (TypeError, ValueError), "dist_process_group"),
]


@pytest.mark.parametrize("change,error,name", BAD, ids=[f"{n}-{i}" for i, (_, _, n) in enumerate(BAD)])
def test_bad_input_names_verls_argument(change, error, name, calls):
    with pytest.raises(error, match=name):
        gk_verl.linear_cross_entropy(**_bad(**change))
    assert calls == []  # refused before our kernel


# ---------------------------------------------------------------------------- patch / unpatch / plugin
def test_plugin_entry_point_patched_verl_on_import():
    (entry,) = [e for e in importlib.metadata.entry_points(group="verl.plugins") if e.name == "grpo_kernels"]
    assert entry.value == "grpo_kernels.integrations.verl_plugin"
    if not PLUGINS_ON:
        pytest.skip("VERL_USE_EXTERNAL_PLUGINS=none: verl loaded no plugin")
    assert PATCHED_BY_IMPORTING_VERL


def test_bf16_logits_keep_fp32_products_as_verls_kernel():
    """verl's kernel keeps each logit's products in fp32 (never rounded to bf16): so does the drop-in
    (fp32_logits=True). Coarse bf16 inputs make every fp32 sum exact, so the check is exact: float64
    of the exact products to fp32 rounding, and far from the logits rounded to bf16."""
    g = torch.Generator().manual_seed(5)
    hidden = (torch.randint(-8, 9, (11, 40), generator=g) / 4).to(torch.bfloat16)
    weight = (torch.randint(-8, 9, (29, 40), generator=g) / 8).to(torch.bfloat16)
    labels = torch.randint(0, 29, (11,), generator=g)
    log_probs, entropy = gk_verl.linear_cross_entropy(hidden, weight, labels, 0.7)
    z = hidden.double() @ weight.double().T
    for logits, close in ((z, True), (z.to(torch.bfloat16).double(), False)):
        want = torch.log_softmax(logits / 0.7, -1).gather(-1, labels[:, None])[:, 0]
        assert torch.allclose(log_probs.double(), want, rtol=1e-5, atol=4e-5) is close
    p = torch.softmax(z / 0.7, -1)
    assert_close64(entropy, -(p * torch.log_softmax(z / 0.7, -1)).sum(-1), torch.float32, scale=4.0, what="entropy")


def test_host_checks_refuse_another_kernel_and_note_an_untested_release(monkeypatch, caplog):
    """patch() checks verl's kernel's signature, not verl's version: another one is refused naming
    verl's version and the piece (nothing patched); an untested release whose checks pass is patched
    with one INFO record."""
    from grpo_kernels.integrations import _host

    was = gk_verl.is_patched()
    gk_verl.unpatch()
    try:
        version = _host.installed_version("verl")
        assert _host.is_tested("verl", version), f"make test-verl runs verl {version}, not in the tested table"

        def other_kernel(hidden, weight, labels, temperature=1.0):
            raise AssertionError("never called")

        monkeypatch.setattr(verl_kernel_module, "linear_cross_entropy", other_kernel)
        with pytest.raises(_host.HostMismatchError, match=rf"verl {re.escape(version)}: .*linear_cross_entropy has"):
            gk_verl.patch()
        assert verl_kernel_module.linear_cross_entropy is other_kernel and not gk_verl.is_patched()
        monkeypatch.undo()
        monkeypatch.setitem(_host.TESTED, "verl", ("0.0.1",))
        with caplog.at_level(logging.INFO, logger=gk_verl.__name__):
            gk_verl.patch()
        assert gk_verl.is_patched()
        assert any("not a release this integration was tested against" in r.getMessage() for r in caplog.records)
    finally:
        monkeypatch.undo()
        gk_verl.unpatch()
        if was:
            gk_verl.patch()


def test_patch_unpatch_is_patched(caplog):
    pytest.importorskip("megatron.core")
    was = gk_verl.is_patched()
    try:
        gk_verl.unpatch()
        gk_verl.unpatch()  # harmless
        assert not gk_verl.is_patched() and is_verls(verl_kernel_module.linear_cross_entropy)
        fused = importlib.import_module("verl.models.mcore.model_forward_fused")
        overlap = importlib.import_module("verl.models.mcore.model_forward_1f1b_overlap")
        assert is_verls(fused.linear_cross_entropy) and is_verls(overlap.linear_cross_entropy)
        kept = verl_kernel_module.linear_cross_entropy
        with caplog.at_level(logging.INFO, logger=gk_verl.__name__):
            gk_verl.patch()
            gk_verl.patch()  # harmless: no second record
        records = [r for r in caplog.records if r.name == gk_verl.__name__ and r.levelno == logging.INFO]
        assert len(records) == 1, [r.getMessage() for r in records]
        for name in ("verl.utils.kernel.linear_cross_entropy.linear_cross_entropy",
                     "verl.models.mcore.model_forward_fused.linear_cross_entropy",
                     "verl.models.mcore.model_forward_1f1b_overlap.linear_cross_entropy"):
            assert name in records[0].getMessage()
        assert gk_verl.is_patched()
        for module in (verl_kernel_module, fused, overlap):
            assert module.linear_cross_entropy is gk_verl.linear_cross_entropy
        # a Megatron forward imported after patch() copies ours; unpatch() restores it too
        saved = sys.modules.pop(fused.__name__)
        try:
            again = importlib.import_module(fused.__name__)
            assert again is not saved and again.linear_cross_entropy is gk_verl.linear_cross_entropy
            gk_verl.unpatch()
            assert again.linear_cross_entropy is kept
        finally:
            sys.modules[fused.__name__] = saved
            sys.modules["verl.models.mcore"].model_forward_fused = saved
        # ``saved`` was out of sys.modules during that unpatch(); back in, a patch/unpatch cycle restores it
        gk_verl.patch()
        gk_verl.unpatch()
        for module in (verl_kernel_module, fused, overlap):
            assert module.linear_cross_entropy is kept  # verl's own object, not a copy
        assert not gk_verl.is_patched()
    finally:
        (gk_verl.patch if was else gk_verl.unpatch)()


def test_megatron_output_processor_runs_ours(patched, calls, tmp_path):
    """verl's Megatron loss head (``model_forward_fused.fused_output_processor``, Megatron Core's
    output-processor hook) with megatron's own parallel state (one gloo rank): Megatron's ``[S, 1, H]``
    and labels ``[1, S]`` reach our kernel through the group megatron hands it."""
    pytest.importorskip("megatron.core")
    import types

    import torch.distributed as dist
    from megatron.core import parallel_state

    fused = importlib.import_module("verl.models.mcore.model_forward_fused")
    assert fused.linear_cross_entropy is gk_verl.linear_cross_entropy
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
        g = torch.Generator().manual_seed(8)
        s, h_size, vocab = 9, 16, 23
        hidden = torch.randn(s, 1, h_size, generator=g, requires_grad=True)
        weight = torch.randn(vocab, h_size, generator=g, requires_grad=True)
        labels = torch.randint(0, vocab, (1, s), generator=g)
        out = fused.fused_output_processor(hidden_states=hidden, output_layer=None, output_weight=weight,
                                           labels=labels, context=fused.FusedOutputProcessorContext(temperature=0.7),
                                           config=types.SimpleNamespace(sequence_parallel=False))
        assert calls == [(s, 1, h_size)]
        c_logp, c_ent = torch.randn(s, generator=g), torch.randn(s, generator=g)
        (out.log_probs * c_logp).sum().add((out.entropy * c_ent).sum()).backward()
        ref_lp, ref_ent, ref_dh, ref_dw, ref_dz = reference64(hidden, weight, labels, 0.7, "none", c_logp, c_ent)
        assert_close64(out.log_probs, ref_lp, scale=float(ref_lp.abs().max()), what="log_probs")
        assert_close64(out.entropy, ref_ent, what="entropy")
        assert_close64(hidden.grad, ref_dh, scale=abs_scale(ref_dz, weight.detach().double()), what="d hidden")
        assert_close64(weight.grad, ref_dw, scale=abs_scale(ref_dz.T, hidden.detach().double().reshape(s, h_size)),
                       what="d weight")
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


# ---------------------------------------------------------------------------- verl's HF forwards
def _tiny(kind: str):
    common = dict(vocab_size=67, hidden_size=24, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=32, attn_implementation="eager")
    if kind == "qwen2":
        return tiny_causal_lm("Qwen2", 11, tie_word_embeddings=False, **common)
    return tiny_causal_lm("Llama", 11, tie_word_embeddings=True, **common)


@pytest.fixture
def restore_forward():
    """patch_forward_with_backends replaces the model class's forward: put it back."""
    saved = []
    yield saved
    for cls, forward in saved:
        cls.forward = forward


def _run(model, backend, input_ids, temperature, c_logp, c_ent):
    from verl.models.transformers.monkey_patch import patch_forward_with_backends

    patch_forward_with_backends(model, use_fused_kernels=True, fused_kernels_backend=backend)
    model.zero_grad(set_to_none=True)
    out = model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), temperature=temperature,
                return_dict=True, use_cache=False)
    log_probs, entropy = out.log_probs.reshape(-1), out.entropy.reshape(-1)  # "torch" gives [B, L]
    (log_probs * c_logp).sum().add((entropy * c_ent).sum()).backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    return log_probs.detach(), entropy.detach(), grads


@pytest.mark.parametrize("kind,shape", [("qwen2", (2, 9)), ("llama", (1, 13))])
def test_verl_forward_matches_its_torch_backend(kind, shape, patched, calls, restore_forward):
    model = _tiny(kind)
    restore_forward.append((type(model), type(model).forward))
    g = torch.Generator().manual_seed(5)
    input_ids = torch.randint(0, model.config.vocab_size, shape, generator=g)
    n = input_ids.numel()
    c_logp, c_ent = torch.randn(n, generator=g), torch.randn(n, generator=g)
    temperature = 0.7
    ref_lp, ref_ent, ref_grads = _run(model, "torch", input_ids, temperature, c_logp, c_ent)
    assert calls == []
    log_probs, entropy, grads = _run(model, "triton", input_ids, temperature, c_logp, c_ent)
    assert calls == [tuple(shape) + (model.config.hidden_size,)]  # verl's triton forward ran our kernel, once
    assert log_probs.dtype == entropy.dtype == torch.float32 and log_probs.shape == entropy.shape == (n,)
    assert_close64(log_probs, ref_lp.double(), scale=float(ref_lp.abs().max()), what="log_probs")
    assert_close64(entropy, ref_ent.double(), scale=float(ref_ent.abs().max()), what="entropy")
    assert grads.keys() == ref_grads.keys()
    for name, grad in grads.items():
        assert_close64(grad, ref_grads[name].double(), scale=float(ref_grads[name].abs().max()), what=f"d {name}")
    if kind == "qwen2":  # without our patch, verl's own kernel is what runs there, and it needs CUDA
        gk_verl.unpatch()
        with pytest.raises((AssertionError, RuntimeError)) as refused:  # NVTX, then ``assert hidden.is_cuda``
            _run(model, "triton", input_ids, temperature, c_logp, c_ent)
        assert any(entry.path.name == "linear_cross_entropy.py" and "verl" in str(entry.path)
                   for entry in refused.traceback)
        assert len(calls) == 1


# ---------------------------------------------------------------------------- tensor parallel (gloo)
@pytest.mark.timeout(300)
def test_tensor_parallel_uneven_shards(background):
    """Groups of 2 and of 3 gloo ranks (tests/verl_helpers.py ``TP_SHARDS``: uneven shards)."""
    context = background["tp"]
    deadline = time.monotonic() + 2 * TP_TIMEOUT_S
    while not context.join(timeout=max(1.0, deadline - time.monotonic())):
        if time.monotonic() > deadline:
            raise AssertionError(f"the gloo ranks did not finish in {2 * TP_TIMEOUT_S} s (a hang)")


# ---------------------------------------------------------------------------- verl's actor update
@pytest.mark.timeout(ENGINE_TIMEOUT_S + 30)
def test_verl_fsdp_engine_actor_step(background):
    process, out, log = background["engine"]
    try:
        process.wait(timeout=ENGINE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        raise AssertionError(f"verl's engine step did not finish in {ENGINE_TIMEOUT_S} s:\n{log.read_text()[-4000:]}")
    assert process.returncode == 0, log.read_text()[-6000:]
    with open(out) as f:
        result = json.load(f)
    assert result["patched_at_start"] is False  # plugins off: nothing of verl's changed before patch()
    # two micro-batches of verl's packed layout [1, nnz, H] reached our kernel, none in the "torch" run
    assert len(result["calls"]) == 2 and all(c[0] == 1 and c[2] == 32 for c in result["calls"])
    torch_run, ours = result["torch"], result["triton"]
    assert torch_run["grads"].keys() == ours["grads"].keys()
    for name, grad in ours["grads"].items():
        ref = torch.tensor(torch_run["grads"][name], dtype=torch.float64)
        assert_close64(torch.tensor(grad), ref, scale=float(ref.abs().max()), what=f"engine d {name}")
        assert ours["moved"][name] > 0 and abs(ours["moved"][name] - torch_run["moved"][name]) < 1e-6
    assert abs(ours["grad_norm"] - torch_run["grad_norm"]) <= 1e-5 * torch_run["grad_norm"]
