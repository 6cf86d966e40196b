"""The memory plan (``grpo.plan``): parameter counts against real models, each layer's saved bytes against
what the layer saves (measured through saved-tensor hooks), the terms' rules, issue 35's goals (131,072
tokens: a Qwen3-8B shape in 80 GB, a Qwen2.5-1.5B shape in 24 GB), the CLI and its usage errors."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

from grpo import plan

pytestmark = pytest.mark.timeout(120)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPES = os.path.join(ROOT, "docs", "shapes")  # config.json of the two goal shapes

SMALL = dict(hidden_size=64, intermediate_size=160, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=300)


@pytest.mark.parametrize("tied", [False, True])
def test_parameter_count_is_the_models(tied):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**SMALL, tie_word_embeddings=tied)
    with torch.device("meta"):
        model = Qwen2ForCausalLM(config)
    unique = {id(p): p.numel() for p in model.parameters()}  # (a tied head counts once)
    assert plan.ModelShape.from_config(config).parameters() == sum(unique.values())


def test_lora_parameter_count_is_peft_s():
    pytest.importorskip("peft")
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**SMALL, tie_word_embeddings=False)
    torch.manual_seed(0)
    for targets in ("all-linear", "q_proj,v_proj,down_proj"):
        model = get_peft_model(Qwen2ForCausalLM(config), LoraConfig(
            r=8, target_modules="all-linear" if targets == "all-linear" else targets.split(","), task_type="CAUSAL_LM"))
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        assert plan.ModelShape.from_config(config).lora_parameters(8, plan.lora_targets(targets)) == trainable


@pytest.mark.parametrize("name, published", [("Qwen2.5-0.5B", 0.49e9), ("Qwen2.5-1.5B", 1.54e9), ("Qwen2.5-7B", 7.61e9),
                                             ("Qwen3-8B", 8.19e9)])
def test_built_in_configs_have_their_published_sizes(name, published):
    assert abs(plan.load_shape(name).parameters() / published - 1) < 0.01
    assert plan.load_shape("Qwen/" + name) == plan.load_shape(name)


@pytest.mark.parametrize("name", ["Qwen3-8B", "Qwen2.5-1.5B"])
def test_the_goal_shapes_config_json_is_the_built_in_and_the_models(name):
    """docs/shapes/NAME/config.json: the same shape as the built-in name, read as JSON and through
    transformers' AutoConfig; its parameter count is the model's (built on the meta device)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = os.path.join(SHAPES, name)
    shape = plan.load_shape(folder)
    assert shape == plan.load_shape(name) == plan.ModelShape.from_config(AutoConfig.from_pretrained(folder))
    assert shape.qk_norm == (name == "Qwen3-8B")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
    assert shape.parameters() == sum({id(p): p.numel() for p in model.parameters()}.values())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_lora_dropout_term_is_what_backward_keeps(dtype):
    """The plan's dropout term (none: the fused dropout keeps no mask, its backward hashes it again) against
    the bytes autograd keeps for a real peft model's forward (grpo.lora's adapters), with and without
    lora_dropout."""
    pytest.importorskip("peft")
    from transformers import Qwen2Config

    from grpo import lora
    from grpo.config import GRPOConfig
    from helpers import saved_for_backward, tiny_causal_lm

    config = Qwen2Config(**SMALL, tie_word_embeddings=False)
    tokens, r = 24, 4
    ids = torch.randint(0, SMALL["vocab_size"], (1, tokens), generator=torch.Generator().manual_seed(0))

    def kept(dropout: float) -> int:
        model = lora.add_adapters(tiny_causal_lm("Qwen2", 0, **SMALL, tie_word_embeddings=False).to(getattr(torch, dtype)),
                                  GRPOConfig(output_dir="unused", use_peft=True, lora_r=r, lora_dropout=dropout)).train()
        return saved_for_backward(lambda: model(ids).logits, exclude=list(model.parameters()))[1]

    shape = plan.ModelShape.from_config(config)
    b = plan.DTYPE_BYTES[dtype]
    per_token = sum(plan.adapter_bytes(d_in, r, 0.1, b, False)[0] - plan.adapter_bytes(d_in, r, 0.0, b, False)[0]
                    for d_in, _ in shape.linears().values())
    assert per_token == 0  # (no mask kept)
    assert kept(0.1) - kept(0.0) == tokens * shape.num_hidden_layers * per_token
    assert kept(0.1) > 0


# ---------------------------------------------------------------------------- each layer's saved bytes
LAYER = dict(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, vocab_size=50, max_position_embeddings=256)
MODES = {"full": (False, 0.0), "lora-dropout-0": (True, 0.0), "lora-dropout-0.05": (True, 0.05)}


def saved_by_one_layer(model, tokens: int) -> int:
    """Bytes of the distinct storages one decoder layer's forward saves for its backward (weights and the
    rotary cos/sin, which every layer shares, left out), measured through saved-tensor hooks."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in weights:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    dtype = next(base.parameters()).dtype
    x = torch.randn(1, tokens, base.config.hidden_size, dtype=dtype, requires_grad=True)
    position_ids = torch.arange(tokens)[None]
    cos_sin = base.model.rotary_emb(x, position_ids)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        base.model.layers[1](x, attention_mask=None, position_embeddings=cos_sin, position_ids=position_ids)
    for t in cos_sin:
        seen.pop(t.untyped_storage().data_ptr(), None)
    return sum(seen.values())


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("chunk", [None, 8])
@pytest.mark.parametrize("fused_norm", [False, True])
def test_a_layers_saved_bytes_are_the_plans(family, dtype, mode, chunk, fused_norm):
    """``plan.layer_terms(...)["saved"]`` (device "cpu": no autocast) is exactly what a Qwen2/Qwen3 layer
    saves for its backward, in full fine-tuning and with LoRA (the trainer's adapters, ``grpo.lora.add_adapters``:
    peft's, all-linear, with the dropout fused into ``lora_A``; dropout 0 and 0.05), fp32 and bf16 weights,
    with and without MLP chunks, with transformers' RMSNorm and the fused one (``fused_norm``)."""
    from grpo import activations
    from helpers import tiny_causal_lm

    use_peft, dropout = MODES[mode]
    if use_peft:
        pytest.importorskip("peft")
    name = {"qwen2": "Qwen2", "qwen3": "Qwen3"}[family]
    model = tiny_causal_lm(name, 0, attn="sdpa", **LAYER).to(getattr(torch, dtype)).train()
    config = model.config
    if use_peft:
        from grpo import lora
        from grpo.config import GRPOConfig

        model = lora.add_adapters(model, GRPOConfig(output_dir="unused", use_peft=True, lora_r=4, lora_dropout=dropout,
                                                    lora_target_modules="all-linear"))
        fused = [m for m in model.modules() if isinstance(m, lora.DropoutLinear)]
        assert len(fused) == (2 * 7 if dropout else 0)  # (the trainer's adapters: the dropout inside lora_A)
    if chunk:
        activations.chunk_mlps(model, chunk)
    if fused_norm:
        activations.fuse_norms(model, "torch")
    tokens = 40
    terms = plan.layer_terms(plan.ModelShape.from_config(config), tokens, plan.DTYPE_BYTES[dtype], full=not use_peft,
                             targets=list(plan.LINEAR_NAMES) if use_peft else [], lora_r=4, lora_dropout=dropout,
                             device="cpu", autocast=False, mlp_chunk_tokens=chunk, fused_norm=fused_norm)
    assert saved_by_one_layer(model, tokens) == terms["saved"]


# ---------------------------------------------------------------------------- the goals and the terms' rules
GOAL = dict(use_peft=True, model_dtype="bfloat16", gradient_checkpointing=True, mlp_chunk_tokens=4096, fused_norm=True)
GB = 10**9


PACKINGS = {"one sequence": 1, "G = 8 packed completions of 16,384": 8}


@pytest.mark.parametrize("packing", list(PACKINGS))
def test_the_goal_s_verdicts_for_both_packings(packing):
    """Issue 45's goal on paper (LoRA, bf16 weights, checkpointing, packing, the fused loss, MLP chunks of
    4,096, the fused RMSNorm, the activation offload): a Qwen3-8B shape at 131,072 tokens within 48 GB and at
    262,144 within 80 GB, a Qwen2.5-1.5B shape at 131,072 within 24 GB; without the offload the 8B at
    131,072 does not fit 48 GB. Fits = peak (the runtime term included) + the allocator reserve <= the device,
    and the largest token count that fits agrees with each verdict."""
    sequences = PACKINGS[packing]
    verdicts = {}
    for name, N, budget, offload in (("Qwen3-8B", 131072, 48 * GB, True), ("Qwen3-8B", 262144, 80 * GB, True),
                                     ("Qwen2.5-1.5B", 131072, 24 * GB, True), ("Qwen3-8B", 131072, 48 * GB, False)):
        p = plan.plan(os.path.join(SHAPES, name), N, activation_offload=offload, sequences=sequences, gpu_memory=budget,
                      **GOAL)
        verdicts[name, N, offload] = p.fits
        assert p.fits == (p.peak + p.allocator_reserve <= budget) and (p.largest_tokens >= N) == p.fits, (name, offload)
        assert p.terms["runtime"] == sum(plan.CUDA_RUNTIME_BYTES.values()) > 0  # the CUDA context is counted
        assert p.terms["no-grad pass"] < p.update_transient  # the old/reference passes stay below the update
        shape = plan.load_shape(name)
        H, L = shape.hidden_size, shape.num_hidden_layers
        if offload:
            block = 1 << (N * H * 2 - 1).bit_length()  # (torch's pinned allocator: a power of two per block)
            assert p.host == {"checkpointed layer inputs": L * block}  # in host memory, not on the device
            assert p.terms["checkpointed layer inputs"] == 2 * N * H * 2  # the layer recomputed and the one prefetched
        else:
            assert p.terms["checkpointed layer inputs"] == L * N * H * 2 and not p.host
    assert verdicts == {("Qwen3-8B", 131072, True): True, ("Qwen3-8B", 262144, True): True,
                        ("Qwen2.5-1.5B", 131072, True): True, ("Qwen3-8B", 131072, False): False}
    # without the offload the 8B's 36 inputs (36 GiB) stay on the device; the 34 of them the offload moves
    # are the whole difference in the peak
    N = 131072
    kept = plan.plan("Qwen3-8B", N, sequences=sequences, **GOAL)
    offloaded = plan.plan("Qwen3-8B", N, sequences=sequences, activation_offload=True, **GOAL)
    assert kept.peak - offloaded.peak == 34 * N * 4096 * 2
    neither = plan.plan("Qwen3-8B", N, gpu_memory=48 * GB, sequences=sequences,
                        **{**GOAL, "mlp_chunk_tokens": None, "fused_norm": False})
    assert not neither.fits and neither.largest_tokens < N


def test_packing_enters_only_through_flash_attn_s_padded_rows():
    """G packed sequences cost one sequence of as many tokens, but for flash-attn 2's varlen backward, whose
    fp32 dq accumulator [N + 128 G, heads, d'] and softmax_d [heads, N + 128 G] pad each sequence by 128 rows."""
    shape = plan.load_shape("Qwen3-8B")
    one, eight = (plan.plan("Qwen3-8B", 131072, sequences=s, **GOAL) for s in (1, 8))
    padding = 128 * 7 * (4 * shape.num_attention_heads * 128 + 4 * shape.num_attention_heads)
    assert eight.terms["attention workspace"] - one.terms["attention workspace"] == padding
    assert {k: v for k, v in eight.terms.items() if k != "attention workspace"} == \
        {k: v for k, v in one.terms.items() if k != "attention workspace"}
    cpu = [plan.plan("Qwen3-8B", 4096, sequences=s, device="cpu", **GOAL).terms for s in (1, 8)]
    assert cpu[0] == cpu[1]  # (packed SDPA on a CPU pads nothing)
    with pytest.raises(ValueError, match="sequences.*tokens"):
        plan.plan("Qwen3-8B", 4, sequences=5)


# ---------------------------------------------------------------------------- the runtime and the allocator reserve
def test_the_runtime_term_is_the_cuda_context_kernels_and_workspaces():
    """On a GPU: the context (local memory for every resident thread of a Hopper GPU at cudaLimitStackSize's
    default, the device heap and printf FIFO, the driver's state), the kernels' images and torch's cuBLAS
    workspaces (sm90: 4,096 KiB x 8, and cuBLASLt's 1 MiB) for two handles; on a CPU the measured process."""
    MiB = 2**20
    parts = plan.CUDA_RUNTIME_BYTES
    assert parts["context: local memory"] == 1024 * 2048 * 132 == 264 * MiB
    assert parts["context: device heap and printf FIFO"] == 9 * MiB
    assert parts["cuBLAS workspaces"] == 2 * (32 * MiB + MiB)
    gpu = plan.plan("Qwen2.5-0.5B", 4096)
    assert gpu.terms["runtime"] == sum(parts.values()) and gpu.runtime == parts
    # torch.cuda.max_memory_allocated sees the workspaces (the caching allocator's) but not the context or kernels
    assert gpu.peak - gpu.allocator_peak == sum(v for k, v in parts.items() if k != "cuBLAS workspaces")
    cpu = plan.plan("Qwen2.5-0.5B", 4096, device="cpu")
    tokenizer = plan.TOKENIZER_BYTES_PER_ENTRY_CPU * plan.KNOWN_CONFIGS["Qwen2.5-0.5B"]["vocab_size"]
    assert cpu.terms["runtime"] == plan.RUNTIME_BYTES_CPU + tokenizer and cpu.allocator_peak == cpu.peak
    assert cpu.reserve == {} and cpu.needed == cpu.peak  # (no caching allocator on a CPU)


def test_allocator_blocks_follow_the_caching_allocator_s_rules():
    MiB = 2**20
    assert [plan.allocator_block(n) for n in (0, 1, 512, 513, MiB + 1, 10 * MiB - 1)] == \
        [0, 512, 512, 1024, MiB + 512, 10 * MiB]
    assert [plan.allocator_block(n) for n in (10 * MiB, 10 * MiB + 1, 96 * MiB, 2**30 + 5)] == \
        [10 * MiB, 12 * MiB, 96 * MiB, 2**30 + 2 * MiB]


@pytest.mark.parametrize("use_peft", [False, True])
def test_the_allocator_reserve_from_the_model_s_own_tensors(use_peft):
    """The reserve's rounding, recomputed from a real model's parameters (built on the meta device, peft's
    adapters for LoRA): each kept tensor's block less its bytes, the layer's transient tensors at 2 MiB each,
    one partly filled segment per pool; its fragmentation: one block of the largest transient tensor, here
    flash-attn's fp32 dq accumulator."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    MiB = 2**20
    shape_config = dict(hidden_size=1000, intermediate_size=2600, num_hidden_layers=2, num_attention_heads=10,
                        num_key_value_heads=2, vocab_size=5003, tie_word_embeddings=False)
    config = Qwen2Config(**shape_config)
    with torch.device("meta"):
        model = Qwen2ForCausalLM(config)
    if use_peft:
        pytest.importorskip("peft")
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=8, target_modules="all-linear", task_type="CAUSAL_LM"))
    weights = [p.numel() * 2 for p in model.parameters() if not p.requires_grad or not use_peft]
    trainable = [p.numel() for p in model.parameters() if p.requires_grad]
    kept = weights + ([n * 4 for n in trainable] * 4 if use_peft else  # adapters, their gradients, two moments
                      [n * 2 for n in trainable] + [n * 4 for n in trainable] * 4)  # bf16 grads; fp32 grads, master, moments
    N, b = 3000, 2
    kept += [N * 1000 * b] * 2  # the checkpointed inputs: two layers on the device
    shape = plan.ModelShape.from_config(config)
    p = plan.plan(shape, N, use_peft=use_peft, lora_r=8, model_dtype="bfloat16", gradient_checkpointing=True,
                  activation_offload=False, mlp_chunk_tokens=512)
    rounding = sum(plan.allocator_block(n) - n for n in kept) + 64 * 2 * MiB + 22 * MiB
    assert p.reserve["block rounding"] == rounding
    c, V, H, I = p.settings["chunk_rows"], 5003, 1000, 2600
    candidates = {"RMSNorm's fp32 upcast": 4 * N * H, "the attention output": b * N * H, "an MLP activation": b * 512 * I,
                  "dq accumulator": 4 * (N + 128) * 10 * 128,  # head_dim 100 rounded up to a multiple of 32
                  "logits block": c * V * b}
    candidates.update({"down_proj's adapter input in fp32": 4 * 512 * I} if use_peft else {"dW": 4 * V * H})
    largest = max(candidates, key=candidates.get)
    assert p.reserve["fragmentation"] == plan.allocator_block(candidates[largest]) and largest in p.largest_transient
    assert p.needed == p.peak + rounding + p.reserve["fragmentation"]


def test_fits_the_largest_count_and_the_json_read_one_predicate(capsys):
    """fits <=> peak + allocator reserve <= the device, for budgets on either side of the peak and of what the
    step needs; the largest token count is the edge of that same predicate; the JSON says the same."""
    settings = dict(GOAL, activation_offload=True)
    p = plan.plan("Qwen2.5-1.5B", 65536, **settings)
    assert p.allocator_reserve > 0
    for budget in (p.peak - 1, p.peak, p.needed - 1, p.needed, p.needed + 1):
        q = plan.plan("Qwen2.5-1.5B", 65536, gpu_memory=budget, **settings)
        assert q.fits == (budget >= p.needed) and (q.largest_tokens >= 65536) == q.fits, budget
        edge = q.largest_tokens
        assert plan.plan("Qwen2.5-1.5B", edge, **settings).needed <= budget < plan.plan("Qwen2.5-1.5B", edge + 1, **settings).needed
    plan.main(["--model", "Qwen2.5-1.5B", "--tokens", "65536", "--use-peft", "--model-dtype", "bfloat16",
               "--gradient-checkpointing", "--activation-offload", "--mlp-chunk-tokens", "4096",
               "--gpu-memory", f"{p.peak}B", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert out["peak_bytes"] == p.peak and out["needed_bytes"] == p.needed and out["fits"] is False  # (the reserve)
    assert out["allocator_reserve_bytes"]["total"] == p.allocator_reserve and out["largest_tokens"] < 65536
    assert out["runtime_bytes"] == plan.CUDA_RUNTIME_BYTES


def test_offload_and_chunk_terms():
    N, common = 32768, dict(use_peft=True, model_dtype="bfloat16", gradient_checkpointing=True, fused_norm=False)
    base = plan.plan("Qwen2.5-1.5B", N, **common)
    offload = plan.plan("Qwen2.5-1.5B", N, activation_offload=True, **common)
    shape = plan.load_shape("Qwen2.5-1.5B")
    H, I, L = shape.hidden_size, shape.intermediate_size, shape.num_hidden_layers
    assert base.terms["checkpointed layer inputs"] == L * N * H * 2 and not base.host
    assert offload.terms["checkpointed layer inputs"] == 2 * N * H * 2
    assert offload.host == {"checkpointed layer inputs": L * 2 ** 27}  # 96 MiB blocks rounded up to 128 MiB
    rest = lambda p: {k: v for k, v in p.terms.items() if k != "checkpointed layer inputs"}  # noqa: E731
    assert rest(offload) == rest(base)
    chunked = plan.plan("Qwen2.5-1.5B", N, mlp_chunk_tokens=1024, **common)
    # the MLP over N tokens: its norm (4H + 4), gate/act/up saved (3 x 2I) and their gradients (3 x 2I);
    # chunked: its input and its input's gradient (2 x 2H) over N, the rest over 1,024 tokens, and the
    # MLP adapters' gradients summed in fp32 (4 B) beside one chunk's (4 B)
    assert base.terms["layer: MLP"] == N * (4 * H + 4 + 6 * 2 * I)
    adapters = 16 * sum(sum(shape.linears()[n]) for n in plan.MLP_LINEARS)
    assert chunked.terms["layer: MLP"] == N * (4 * H + 4 + 2 * 2 * H) + 1024 * (6 * 2 * I + 2 * H) + adapters * 8
    assert chunked.terms["layer: LoRA inputs (MLP)"] * N == base.terms["layer: LoRA inputs (MLP)"] * 1024
    whole = plan.plan("Qwen2.5-1.5B", N, mlp_chunk_tokens=N, **common)  # one chunk: the module as it is
    assert whole.terms == base.terms


@pytest.mark.parametrize("x_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("dropout", [0.0, 0.05])
@pytest.mark.parametrize("autocast", [False, True])
def test_an_adapter_keeps_what_adapter_bytes_says(x_dtype, dropout, autocast):
    """``plan.adapter_bytes`` per token against what one trainer adapter (peft's ``lora.Linear`` on a frozen
    linear, ``grpo.lora.fuse_dropout`` applied) saves for its backward, measured through saved-tensor hooks at
    two token counts (their difference: the per-token bytes; the weights' autocast copies are constants).
    Autocast is a CPU's bf16 autocast here, which dispatches linear as CUDA's does."""
    pytest.importorskip("peft")
    from peft import LoraConfig, get_peft_model

    from grpo import lora
    from helpers import saved_for_backward

    d_in, d_out, r = 48, 40, 4
    torch.manual_seed(0)
    model = get_peft_model(torch.nn.Sequential(torch.nn.Linear(d_in, d_out, bias=False)).to(getattr(torch, x_dtype)),
                           LoraConfig(r=r, lora_dropout=dropout, target_modules=["0"]), autocast_adapter_dtype=True)
    lora.fuse_dropout(model)
    model.train()
    kept = {}
    for tokens in (16, 40):
        x = torch.randn(tokens, d_in, dtype=getattr(torch, x_dtype), requires_grad=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            kept[tokens] = saved_for_backward(lambda: model(x), exclude=[*model.parameters(), x])[1]
    per_token, keeps_x = plan.adapter_bytes(d_in, r, dropout, plan.DTYPE_BYTES[x_dtype], autocast)
    assert (kept[40] - kept[16]) == 24 * per_token
    # x itself is among what it keeps exactly where peft's fp32 cast is no copy and the adapter's A reads it
    assert keeps_x == (x_dtype == "float32" and not (autocast and dropout == 0))


def test_lora_dropout_s_cost_and_what_dropout_0_saves():
    """Per adapted linear with ``in`` inputs and bf16 activations: with dropout the fused ``lora_A`` keeps peft's
    fp32 cast of the input and no mask (4 B: its backward hashes the mask again), without dropout ``lora_A``
    keeps the fp32 cast (4 B), or under bf16 autocast its bf16 copy (2 B). So ``lora_dropout=0`` saves nothing
    without autocast, 2 B an input element under autocast (the trainer's CUDA default)."""
    assert plan.adapter_bytes(100, 8, 0.05, 2, True) == (100 * 4 + 8 * 2, False)
    assert plan.adapter_bytes(100, 8, 0.05, 2, False) == (100 * 4 + 8 * 4, False)
    assert plan.adapter_bytes(100, 8, 0.0, 2, True) == (100 * 2 + 8 * 2, False)
    assert plan.adapter_bytes(100, 8, 0.0, 2, False) == (100 * 4 + 8 * 4, False)
    assert plan.adapter_bytes(100, 8, 0.05, 4, False) == (8 * 4, True)  # no mask; x is the layer's input
    assert plan.adapter_bytes(100, 8, 0.0, 4, False) == (8 * 4, True)  # lora_A reads x itself
    kw = dict(use_peft=True, model_dtype="bfloat16", gradient_checkpointing=True)
    p05, p0 = plan.plan("Qwen3-8B", 131072, **kw), plan.plan("Qwen3-8B", 131072, lora_dropout=0.0, **kw)
    lora = lambda p: p.terms["layer: LoRA inputs (attention)"] + p.terms["layer: LoRA inputs (MLP)"]  # noqa: E731
    ins = sum(plan.load_shape("Qwen3-8B").linears()[n][0] for n in plan.LINEAR_NAMES)
    assert lora(p05) - lora(p0) == 131072 * ins * 2  # CUDA, bf16 autocast: fp32 copy (4 B) vs bf16 copy (2 B)
    cpu05, cpu0 = (plan.plan("Qwen3-8B", 4096, lora_dropout=p, device="cpu", **kw) for p in (0.05, 0.0))
    assert lora(cpu05) == lora(cpu0)  # no autocast: the same


@pytest.mark.parametrize("settings", [
    dict(), dict(gradient_checkpointing=True), dict(use_peft=True, model_dtype="bfloat16", gradient_checkpointing=True),
    dict(use_peft=True, model_dtype="bfloat16", gradient_checkpointing=True, activation_offload=True, mlp_chunk_tokens=512),
    dict(model_dtype="bfloat16", mlp_chunk_tokens=300, device="cpu"),
])
def test_every_activation_term_grows_with_the_tokens_and_the_largest_count_is_the_edge(settings):
    previous = None
    for n in [*range(1000, 1200, 2), 4096, 8191, 8192, 8193, 65536]:
        p = plan.plan("Qwen2.5-1.5B", n, **settings)
        if previous is not None:
            for name, value in p.terms.items():
                if name != "loss chunk":  # (the loss's default chunk: grpo_kernels' rule, not this plan's)
                    assert value >= previous.terms[name], (name, n)
        previous = p
    budget = 60 * GB
    edge = plan.plan("Qwen2.5-1.5B", 1024, gpu_memory=budget, **settings).largest_tokens
    assert 0 < edge < plan.MAX_SEARCH_TOKENS
    assert plan.plan("Qwen2.5-1.5B", edge, **settings).needed <= budget < plan.plan("Qwen2.5-1.5B", edge + 1, **settings).needed
    assert plan.plan("Qwen2.5-1.5B", 1024, gpu_memory=2**20, **settings).largest_tokens == 0  # the weights alone do not fit


def test_terms_scale_as_their_rules_say():
    a = plan.plan("Qwen2.5-0.5B", 4096, gradient_checkpointing=False, bf16=False)
    b = plan.plan("Qwen2.5-0.5B", 8192, gradient_checkpointing=False, bf16=False)
    assert b.terms["rollout KV cache"] == 2 * a.terms["rollout KV cache"]
    for name in ("saved by the other layers", "layer: attention", "layer: MLP", "edges"):
        assert b.terms[name] == 2 * a.terms[name], name  # linear in tokens (no [N, N] attention)
    heads = plan.load_shape("Qwen2.5-0.5B").num_attention_heads  # (flash-attn's 128 padded rows: a constant)
    assert b.terms["attention workspace"] == 2 * a.terms["attention workspace"] - 128 * (4 * heads * 64 + 4 * heads)
    # fp32 weights under bf16 autocast: each layer also keeps a bf16 copy of its linears' weights
    autocast = plan.plan("Qwen2.5-0.5B", 4096, gradient_checkpointing=False)
    shape = plan.load_shape("Qwen2.5-0.5B")
    for term, names in (("layer: attention", plan.ATTENTION_LINEARS), ("layer: MLP", plan.MLP_LINEARS)):
        assert autocast.terms[term] - a.terms[term] == sum(2 * i * o for n, (i, o) in shape.linears().items() if n in names)
    assert b.terms["weights"] == a.terms["weights"]
    bf16 = plan.plan("Qwen2.5-0.5B", 4096, model_dtype="bfloat16")
    assert bf16.terms["weights"] * 2 == a.terms["weights"]
    # full fine-tuning in bf16: fp32 masters + moments, 12 B, and bf16 + fp32 gradients, 6 B
    P = plan.load_shape("Qwen2.5-0.5B").parameters()
    assert bf16.terms["optimizer state"] == 12 * P and bf16.terms["gradients"] == 6 * P
    full = plan.plan("Qwen2.5-1.5B", 32768, gradient_checkpointing=True, beta=0.04, gpu_memory=24 * GB)
    assert not full.fits  # full fine-tuning: 31 GB of weights, reference, gradients and AdamW state alone
    assert full.terms["weights"] == full.terms["reference"] == 4 * plan.load_shape("Qwen2.5-1.5B").parameters()
    assert full.peak == full.persistent + max(full.update_transient, full.terms["rollout KV cache"])


def test_config_json_path_and_bad_model(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**SMALL, "tie_word_embeddings": True}))
    assert plan.load_shape(str(path)) == plan.load_shape(str(tmp_path))
    with pytest.raises(ValueError, match="--model"):
        plan.load_shape(str(tmp_path / "nope"))
    for text in ("{not json", "[1, 2]", json.dumps({**SMALL, "hidden_size": "wide"}), json.dumps({"hidden_size": 64}),
                 json.dumps({**SMALL, "num_hidden_layers": 0}), json.dumps({**SMALL, "head_dim": -1})):
        path.write_text(text)
        with pytest.raises(ValueError, match="--model"):
            plan.load_shape(str(path))
    assert plan.parse_size("24GiB") == 24 * 2**30 and plan.parse_size("24GB") == 24 * 10**9


@pytest.mark.parametrize("flags, named", [
    (["--gpu-memory", "lots"], "--gpu-memory"), (["--gpu-memory", "0"], "--gpu-memory"),
    (["--gpu-memory", "0GB"], "--gpu-memory"), (["--gpu-memory", "1e999"], "--gpu-memory"),
    (["--gpu-memory", "nan"], "--gpu-memory"), (["--gpu-memory", "inf"], "--gpu-memory"),
    (["--gpu-memory", "-8GB"], "--gpu-memory"),
    (["--mlp-chunk-tokens", "0"], "--mlp-chunk-tokens"), (["--mlp-chunk-tokens", "-4"], "--mlp-chunk-tokens"),
    (["--mlp-chunk-tokens", "2.5"], "--mlp-chunk-tokens"), (["--mlp-chunk-tokens", "many"], "--mlp-chunk-tokens"),
    (["--activation-offload", "--no-gradient-checkpointing"], "--activation-offload"), (["--activation-offload", "yes"], "unrecognized arguments: yes"),
])
def test_cli_usage_errors_name_the_flag(flags, named, capsys):
    with pytest.raises(SystemExit) as exit_:
        plan.main(["--model", "Qwen2.5-1.5B", "--tokens", "4096", *flags])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and named in err.splitlines()[-1], err


def test_cli_refuses_a_config_it_cannot_read(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 64, "model_type": "qwen2"}))
    with pytest.raises(SystemExit) as exit_:
        plan.main(["--model", str(tmp_path), "--tokens", "4096"])
    assert exit_.value.code == 2 and "--model" in capsys.readouterr().err


def test_python_api_refuses_bad_settings_naming_them():
    for kw, error, named in ((dict(mlp_chunk_tokens=True), TypeError, "mlp_chunk_tokens"),
                             (dict(mlp_chunk_tokens=1.5), TypeError, "mlp_chunk_tokens"),
                             (dict(mlp_chunk_tokens=0), ValueError, "mlp_chunk_tokens"),
                             (dict(activation_offload="yes", gradient_checkpointing=True), TypeError, "activation_offload"),
                             (dict(activation_offload=True, gradient_checkpointing=False), ValueError, "activation_offload"),
                             (dict(gpu_memory=0), ValueError, "gpu_memory"),
                             (dict(gpu_memory=math.inf), ValueError, "gpu_memory"),
                             (dict(gpu_memory=-1.0), ValueError, "gpu_memory")):
        with pytest.raises(error, match=named):
            plan.plan("Qwen2.5-1.5B", 4096, **kw)


def test_cli_prints_every_term_the_host_total_and_the_verdict(capsys):
    from grpo.__main__ import main

    main(["plan", "--model", os.path.join(SHAPES, "Qwen3-8B"), "--tokens", "131072", "--use-peft", "--model-dtype",
          "bfloat16", "--gradient-checkpointing", "--activation-offload", "--mlp-chunk-tokens", "4096", "--gpu-memory", "80GB"])
    out = capsys.readouterr().out
    for term in ("weights", "reference", "gradients", "optimizer state", "checkpointed layer inputs", "layer: attention",
                 "layer: LoRA inputs (attention)", "layer: MLP", "attention workspace",
                 "flash-attn 2 varlen backward (assumed)", "edges", "loss chunk", "rollout KV cache", "peak",
                 "host memory: checkpointed layer inputs"):
        assert term in out, term
    assert "fits in" in out and "NOT" not in out and "largest token count per micro-batch that fits: " in out
    assert "host memory per node (1 rank)" in out and "no-grad pass" in out and "RMSNorm backward" in out
    main(["plan", "--model", "Qwen3-8B", "--tokens", "131072", "--use-peft", "--model-dtype", "bfloat16",
          "--gradient-checkpointing", "--mlp-chunk-tokens", "4096", "--gpu-memory", "48GB"])  # (no offload)
    out = capsys.readouterr().out
    for words in ("runtime", "CUDA context", "allocator reserve", "fragmentation", "needed", "does NOT fit in 48 GB"):
        assert words in out, words
    main(["plan", "--model", "Qwen2.5-1.5B", "--tokens", "32768", "--gpu-memory", "24GB", "--json"])
    result = json.loads(capsys.readouterr().out)
    assert result["fits"] is False and result["largest_tokens"] < 32768 and result["host_bytes"] == {}


# ---- the plan CLI is a CLI: every bad value a usage error naming the flag, before anything is computed
def plan_cli(*argv: str):
    from grpo.__main__ import main

    main(["plan", *argv])


def declared_bad_values(cls, name):
    """Values the field's declaration refuses, as command-line text (just outside its range, NaN, inf,
    a value of another type, an unknown choice)."""
    from grpo_kernels.bounds import declarations

    d = declarations(cls)[name]
    if d.kind is bool:
        return []
    if d.kind is str:
        return ["nope"] if d.choices else []
    out = ["x"] + (["2.5"] if d.kind is int else [])
    b = d.bounds
    if b is not None:
        if b.low is not None:
            out.append(str(b.low if b.low_open else b.low - 1))
        if b.high is not None:
            out.append(str(b.high if b.high_open else b.high * 2 + 1))
        if b.finite and d.kind is float:
            out += ["nan", "inf", "1e400"]
    return out


def plan_flag_cases():
    from grpo.config import GRPOConfig

    cases = [(plan.PlanSettings, name) for name in ("tokens", "sequences", "rollout_tokens", "device", "gpu_memory",
                                                    "ranks_per_node", "host_memory")]
    return cases + [(GRPOConfig, name) for name in plan.PLAN_CONFIG_FIELDS]


@pytest.mark.parametrize("cls, name", plan_flag_cases(), ids=[n for _, n in plan_flag_cases()])
def test_every_plan_flag_refuses_what_its_declaration_refuses(cls, name, capsys):
    flag = "--" + name.replace("_", "-")
    base = ["--model", "Qwen2.5-0.5B", "--tokens", "64", "--use-peft"]
    values = declared_bad_values(cls, name)
    assert values or name in ("use_peft", "gradient_checkpointing", "lora_target_modules", "activation_offload", "bf16",
                              "fused_norm")
    for value in values:
        with pytest.raises(SystemExit) as done:
            plan_cli(*base, f"{flag}={value}")
        err = capsys.readouterr().err
        line = [x for x in err.splitlines() if "error:" in x][-1]
        assert done.value.code == 2 and flag in line, (value, line)


@pytest.mark.parametrize("argv, named", [
    (["--lora-target-modules", "nope_proj"], "--lora-target-modules"),
    (["--lora-target-modules", "input_layernorm"], "--lora-target-modules"),  # a norm: LoRA adapts linear layers
    (["--lora-target-modules", ","], "--lora-target-modules"),
    (["--gpu-memory", "0"], "--gpu-memory"), (["--gpu-memory", "1e400"], "--gpu-memory"), (["--gpu-memory=-3GB"], "--gpu-memory"),
    (["--gpu-memory", "lots"], "--gpu-memory"), (["--gpu-memory", "1e300"], "--gpu-memory"),
    (["--lora-r", "0"], "--lora-r"), (["--lora-r=-4"], "--lora-r"), (["--lora-dropout", "3"], "--lora-dropout"),
    (["--beta", "nan"], "--beta"), (["--model-dtype", "float16"], "--model-dtype"),
])
def test_the_issue_s_examples_are_usage_errors(argv, named, capsys):
    with pytest.raises(SystemExit) as done:
        plan_cli("--model", "Qwen2.5-0.5B", "--tokens", "64", "--use-peft", *argv)
    line = [x for x in capsys.readouterr().err.splitlines() if "error:" in x][-1]
    assert done.value.code == 2 and named in line, line


@pytest.mark.parametrize("content", [
    "not json", "[1, 2]", '"a string"', json.dumps({"model_type": "bert", "hidden_size": 8, "vocab_size": 10}),
    json.dumps({**SMALL, "num_attention_heads": 0}), json.dumps({**SMALL, "hidden_size": 65}),
    json.dumps({**SMALL, "vocab_size": "300"}), json.dumps({**SMALL, "num_hidden_layers": True}),
])
def test_a_config_that_is_not_a_decoder_s_is_a_usage_error_naming_model(content, tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(content)
    with pytest.raises(SystemExit) as done:
        plan_cli("--model", str(path), "--tokens", "64")
    line = [x for x in capsys.readouterr().err.splitlines() if "error:" in x][-1]
    assert done.value.code == 2 and "--model" in line and str(path) in line, line


def test_plan_function_refuses_what_the_trainer_refuses():
    """plan() reads GRPOConfig's declarations: the settings the trainer refuses are refused here too, by name."""
    for kw, name in ((dict(use_peft=True, lora_r=0), "lora_r"), (dict(use_peft=True, lora_r=-4), "lora_r"),
                     (dict(lora_dropout=3.0), "lora_dropout"), (dict(beta=float("nan")), "beta"),
                     (dict(use_peft=True, lora_target_modules="nope_proj"), "lora_target_modules"),
                     (dict(model_dtype="float16"), "model_dtype"), (dict(rollout_tokens=0), "rollout_tokens"),
                     (dict(gpu_memory=0), "gpu_memory"), (dict(device="tpu"), "device"),
                     (dict(release_memory="sometimes"), "release_memory"), (dict(release_memory=True), "release_memory")):
        with pytest.raises(ValueError, match=name):
            plan.plan("Qwen2.5-0.5B", 64, **kw)
    with pytest.raises(ValueError, match="tokens"):
        plan.plan("Qwen2.5-0.5B", 0)


def test_a_cpu_plan_says_when_freed_heap_is_not_counted(capsys):
    """The CPU plan counts what is live; with release_memory 'never' or 'phases' glibc keeps freed heap the plan
    does not model, and its runtime note says so (the CLI's flag reaches it)."""
    notes = {policy: plan.plan("Qwen2.5-0.5B", 64, device="cpu", release_memory=policy).notes["runtime"]
             for policy in ("never", "phases", "always")}
    assert "not counted" in notes["never"] and "not counted" in notes["phases"] and "not counted" not in notes["always"]
    plan_cli("--model", "Qwen2.5-0.5B", "--tokens", "64", "--device", "cpu", "--release-memory", "phases")
    assert "release_memory='phases'" in capsys.readouterr().out


def test_gpu_memory_is_in_gigabytes_and_the_verdict_is_printed(capsys):
    plan_cli("--model", "Qwen2.5-0.5B", "--tokens", "64", "--gpu-memory", "80")
    out = capsys.readouterr().out
    assert "fits in 80 GB" in out
    plan_cli("--model", "Qwen2.5-7B", "--tokens", "4096", "--gpu-memory", "24GiB", "--json")
    result = json.loads(capsys.readouterr().out)
    assert result["gpu_memory_bytes"] == 24 * 2**30 and result["fits"] is False
    assert plan.parse_size("80") == 80e9 and plan.parse_size("512MiB") == 2**29


@pytest.mark.parametrize("model, dtype, device", [("Qwen2.5-0.5B", "float32", "cuda"), ("Qwen2.5-1.5B", "bfloat16", "cuda"),
                                                  ("Qwen2.5-0.5B", "float32", "cpu")])
def test_the_peak_never_falls_as_tokens_grow(model, dtype, device):
    """The loss chunk of N tokens splits them into equal chunks, so a few more tokens could take a smaller
    chunk (1,082 tokens planned more than 1,084): the plan now takes the largest chunk of any micro-batch
    of at most N tokens, and every term grows with N."""
    from grpo_kernels.autograd import default_chunk_size

    shape = plan.load_shape(model)
    rows = default_chunk_size(shape.vocab_size, shape.hidden_size, torch.bfloat16 if dtype == "bfloat16" else torch.float32,
                              torch.device(device))
    # (around each multiple of the chunk, where one more token makes one more, smaller, chunk)
    counts = sorted(set(range(1, 5000, 37)) | {k * rows + d for k in range(1, 5) for d in range(-2, 3)})
    previous = None
    for n in counts:
        p = plan.plan(model, n, model_dtype=dtype, device=device)
        if previous is not None:
            assert p.peak >= previous.peak and p.terms["loss chunk"] >= previous.terms["loss chunk"], n
        previous = p


def test_lora_s_persistent_terms_are_what_a_trainer_step_leaves(tmp_path):
    """The plan's LoRA gradients and optimizer state against the trainer's own set-up after one AdamW step
    (grpo.trainer.setup_training with use_peft: peft's adapters, grpo.precision.adamw): the bytes of every
    gradient and every moment tensor. benchmarks/results/lora_memory-cpu-20261202.md compares the whole
    CLI run's peak with the plan."""
    pytest.importorskip("peft")
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from grpo.config import GRPOConfig
    from grpo.trainer import setup_training

    config = Qwen2Config(**SMALL, tie_word_embeddings=False)
    torch.manual_seed(0)
    cfg = GRPOConfig(output_dir=str(tmp_path), use_peft=True, lora_r=8, beta=0.04, backend="torch")
    _, policy, _, optimizer = setup_training(Qwen2ForCausalLM(config), cfg, torch.device("cpu"))
    policy.train()
    ids = torch.randint(0, SMALL["vocab_size"], (2, 12))
    policy.model(input_ids=ids).logits.float().pow(2).mean().backward()
    optimizer.step()
    params = [p for p in policy.parameters() if p.requires_grad]
    grads = sum(p.grad.nbytes for p in params)
    moments = sum(t.nbytes for p in params for t in optimizer.state[p].values() if t.dim())  # (not the step counts)
    terms = plan.plan(plan.ModelShape.from_config(config), 24, use_peft=True, lora_r=8, beta=0.04).terms
    assert terms["gradients"] == grads and terms["optimizer state"] == moments


# ---------------------------------------------------------------------------- issue 45: the layer's height, the host
SMALL_LAYER = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 256, "intermediate_size": 1024,
               "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
               "rms_norm_eps": 1e-6, "max_position_embeddings": 1024, "tie_word_embeddings": False}


@pytest.mark.parametrize("fused_norm", [True, False])
def test_the_plan_s_per_token_slope_bounds_a_measured_layer(tmp_path, fused_norm):
    """One decoder layer as the trainer runs it (bf16 weights, LoRA on every linear with dropout, MLP chunks of
    64, non-reentrant checkpointing, CPU bf16 autocast; benchmarks.long_context.one_layer), its peak
    allocation from the torch profiler's events at 128 and 384 tokens (both above the chunk: the chunk's
    terms are the same at both, so the difference is the per-token part alone): the per-token slope of
    ``plan.layer_peak`` against the measured one, within 10% either way. No CPU-vs-CUDA allowance: both are
    the CPU's own allocations, counted by the profiler (measured 2026-12-07: plan / measured 0.949 fused,
    0.957 transformers' norm; the real-width figures are in benchmarks/results/layer_peak-cpu-*.md)."""
    pytest.importorskip("peft")
    from benchmarks import long_context as LC

    (tmp_path / "config.json").write_text(json.dumps(SMALL_LAYER))
    low, high = (LC.one_layer(str(tmp_path), n, fused_norm=fused_norm, chunk=64) for n in (128, 384))
    measured = (high["measured_bytes"] - low["measured_bytes"]) / 256
    planned = (high["planned_bytes"] - low["planned_bytes"]) / 256
    assert measured > 0 and 0.9 <= planned / measured <= 1.1, (planned, measured)


def test_pinned_blocks_round_up_to_a_power_of_two_unless_the_allocator_setting_says_otherwise():
    MiB = 2**20
    assert plan.pinned_round_threshold({}) is None
    assert plan.pinned_round_threshold({"PYTORCH_ALLOC_CONF": "expandable_segments:True,pinned_max_round_threshold_mb:64"}) \
        == 64 * MiB
    assert plan.pinned_round_threshold({"PYTORCH_CUDA_ALLOC_CONF": "pinned_max_round_threshold_mb:8"}) == 8 * MiB
    assert [plan.pinned_block(n, None) for n in (0, 1, 3, 96 * MiB, 128 * MiB)] == [0, 1, 4, 128 * MiB, 128 * MiB]
    assert plan.pinned_block(96 * MiB, 64 * MiB) == 96 * MiB and plan.pinned_block(48 * MiB, 64 * MiB) == 64 * MiB


def test_host_memory_per_node_and_its_verdict(monkeypatch):
    """Every rank on a machine pins its own copy of the checkpointed inputs: the host need per node is ranks x
    the per-rank blocks, judged against --host-memory; the allocator setting removes the rounding."""
    kw = dict(use_peft=True, model_dtype="bfloat16", gradient_checkpointing=True, activation_offload=True)
    N, shape = 131072, plan.load_shape("Qwen2.5-1.5B")
    rounded = plan.plan("Qwen2.5-1.5B", N, ranks_per_node=8, host_memory=100 * GB, **kw)
    per_rank = shape.num_hidden_layers * 512 * 2**20  # 384 MiB blocks rounded up to 512 MiB
    assert rounded.host == {"checkpointed layer inputs": per_rank} and rounded.host_per_node == 8 * per_rank
    assert rounded.host_fits is False and "does NOT fit" in rounded.format() and "power of two" in rounded.format()
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "pinned_max_round_threshold_mb:256")
    exact = plan.plan("Qwen2.5-1.5B", N, ranks_per_node=8, host_memory=100 * GB, **kw)
    assert exact.host_per_node == 8 * shape.num_hidden_layers * N * shape.hidden_size * 2 and exact.host_fits is True
    assert plan.plan("Qwen2.5-1.5B", N, **kw).host_fits is None  # (no host size given)
    with pytest.raises(ValueError, match="ranks_per_node"):
        plan.plan("Qwen2.5-1.5B", N, ranks_per_node=0, **kw)


def test_the_fused_norm_s_terms_and_the_no_grad_pass():
    """transformers' RMSNorm keeps its fp32 upcast (4H + 4 a norm) and its backward holds 4.5 fp32 copies
    beside d x; the fused one keeps 4 (the attention's, whose input the layer keeps) and bH + 4 (the MLP's),
    and its backward holds d x; on CUDA the fused plan's layer backward is lower by at least the difference
    in what the norms keep. The no-grad (old / reference) pass stays below the update."""
    shape, N, b = plan.load_shape("Qwen3-8B"), 8192, 2
    H = shape.hidden_size
    args = dict(full=False, targets=list(plan.LINEAR_NAMES), lora_r=16, lora_dropout=0.05, device="cuda", autocast=True,
                mlp_chunk_tokens=1024)
    python, fused = (plan.layer_terms(shape, N, b, fused_norm=f, **args) for f in (False, True))
    assert python["norm_backward"] == N * b * H + N * 18 * H and fused["norm_backward"] == N * b * H
    assert python["mlp_norm"] == N * (4 * H + 4) and fused["mlp_norm"] == N * (b * H + 4)
    assert plan.layer_peak(fused) < plan.layer_peak(python)
    for f in (False, True):
        p = plan.plan("Qwen3-8B", N, **{**GOAL, "fused_norm": f})
        assert 0 < p.terms["no-grad pass"] < p.update_transient


def test_the_hash_block_the_plan_counts_is_lora_s():
    from grpo import lora

    assert plan.HASH_BLOCK_ELEMENTS == lora.HASH_BLOCK


def test_plans_defaults_are_the_configs_own():
    """plan()'s keywords for GRPOConfig's settings default to the config's defaults, read from its fields (issue 46:
    not restated): the same values, and a default changed in the config is the plan's."""
    import dataclasses
    import inspect

    from grpo.config import GRPOConfig

    signature = inspect.signature(plan.plan).parameters
    config = {f.name: f.default for f in dataclasses.fields(GRPOConfig)}
    assert set(plan.PLAN_CONFIG_FIELDS) <= set(signature)
    for name in plan.PLAN_CONFIG_FIELDS:
        assert signature[name].default == config[name] and plan.CONFIG_DEFAULTS[name] is config[name], name


def test_a_run_offloading_to_more_host_memory_than_the_machine_has_is_warned_with_the_numbers(tmp_path, monkeypatch, caplog):
    """Offload (on CUDA) pins every layer's checkpointed input in host memory: a run whose ranks on this machine
    need more than it has gets one WARNING at its start naming activation_offload, the GiB needed per rank and
    per machine, and the machine's GiB; with enough memory no warning."""
    import logging

    from transformers import AutoConfig

    from helpers import tiny_config

    config = AutoConfig.from_pretrained(os.path.join(os.path.dirname(plan.__file__), "..", "docs", "shapes", "Qwen2.5-1.5B"))
    cfg = tiny_config(tmp_path, use_peft=True, model_dtype="bfloat16", gradient_checkpointing=True, activation_offload=True)
    N = 131072  # 28 blocks of 384 MiB, each pinned as 512 MiB: 14 GiB a rank
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    for machine, warned in ((16 * 2**30, True), (64 * 2**30, False)):
        monkeypatch.setattr(plan, "physical_memory", lambda: machine)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="grpo.plan"):
            result = plan.log_for_run(config, cfg, N, "cuda")
        assert result.host_per_node == 2 * 28 * 512 * 2**20 and result.host_fits is (not warned)
        assert [r.levelname for r in caplog.records] == (["WARNING"] if warned else [])
        if warned:
            assert "activation_offload" in caplog.text and "28.00 GiB" in caplog.text and "2 rank(s) x 14.00 GiB" in caplog.text
            assert "16.00 GiB" in caplog.text and "power of two" in caplog.text
