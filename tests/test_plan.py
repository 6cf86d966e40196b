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
def test_a_layers_saved_bytes_are_the_plans(family, dtype, mode, chunk):
    """``plan.layer_terms(...)["saved"]`` (device "cpu": no autocast, a CPU's dropout keeps fp32 noise) is
    exactly what a Qwen2/Qwen3 layer saves for its backward, in full fine-tuning and with LoRA (peft,
    all-linear, dropout 0 and 0.05), fp32 and bf16 weights, with and without MLP chunks."""
    import transformers

    from grpo import activations

    use_peft, dropout = MODES[mode]
    if use_peft:
        pytest.importorskip("peft")
    name = {"qwen2": "Qwen2", "qwen3": "Qwen3"}[family]
    config = getattr(transformers, f"{name}Config")(**LAYER)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = getattr(transformers, f"{name}ForCausalLM")(config).to(getattr(torch, dtype)).train()
    if use_peft:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, lora_dropout=dropout, target_modules="all-linear",
                                                 task_type="CAUSAL_LM"), autocast_adapter_dtype=True)
    if chunk:
        activations.chunk_mlps(model, chunk)
    tokens = 40
    terms = plan.layer_terms(plan.ModelShape.from_config(config), tokens, plan.DTYPE_BYTES[dtype], full=not use_peft,
                             targets=list(plan.LINEAR_NAMES) if use_peft else [], lora_r=4, lora_dropout=dropout,
                             device="cpu", autocast=False, mlp_chunk_tokens=chunk)
    assert saved_by_one_layer(model, tokens) == terms["saved"]


# ---------------------------------------------------------------------------- the goals and the terms' rules
GOAL = dict(use_peft=True, model_dtype="bfloat16", gradient_checkpointing=True, mlp_chunk_tokens=4096)
GB = 10**9


def test_131072_tokens_fit_80gb_for_an_8b_and_24gb_for_a_1_5b_shape_with_offload_and_chunks():
    """Issue 35's goal on paper: LoRA, bf16 weights, checkpointing, packing, the fused loss, offload and MLP
    chunks (one sequence or G = 8 packed completions of 16,384: one plan, every term being linear in N)."""
    for name, budget in (("Qwen3-8B", 80 * GB), ("Qwen2.5-1.5B", 24 * GB)):
        p = plan.plan(os.path.join(SHAPES, name), 131072, activation_offload=True, gpu_memory=budget, **GOAL)
        assert p.fits and p.peak <= budget and p.largest_tokens >= 131072, name
        shape = plan.load_shape(name)
        N, H, L = 131072, shape.hidden_size, shape.num_hidden_layers
        assert p.host == {"checkpointed layer inputs": L * N * H * 2}  # in host memory, not on the device
        assert p.terms["checkpointed layer inputs"] == 2 * N * H * 2  # the layer recomputed and the one prefetched
    offloaded = plan.plan("Qwen3-8B", 131072, activation_offload=True, **GOAL)
    # without the offload the 8B's 36 inputs (36 GiB) are on the device: 73.5 GiB of 80 GB's 74.5 GiB on
    # paper, none of the headroom the CUDA context and the allocator's rounding need; without chunks too: over
    kept = plan.plan("Qwen3-8B", 131072, gpu_memory=80 * GB, **GOAL)
    assert kept.terms["checkpointed layer inputs"] == 36 * 131072 * 4096 * 2 and not kept.host
    assert kept.peak - offloaded.peak == 34 * 131072 * 4096 * 2 and kept.peak > 0.95 * 80 * GB
    neither = plan.plan("Qwen3-8B", 131072, gpu_memory=80 * GB, **{**GOAL, "mlp_chunk_tokens": None})
    assert not neither.fits and neither.largest_tokens < 131072


def test_offload_and_chunk_terms():
    N, common = 32768, dict(use_peft=True, model_dtype="bfloat16", gradient_checkpointing=True)
    base = plan.plan("Qwen2.5-1.5B", N, **common)
    offload = plan.plan("Qwen2.5-1.5B", N, activation_offload=True, **common)
    shape = plan.load_shape("Qwen2.5-1.5B")
    H, I, L = shape.hidden_size, shape.intermediate_size, shape.num_hidden_layers
    assert base.terms["checkpointed layer inputs"] == L * N * H * 2 and not base.host
    assert offload.terms["checkpointed layer inputs"] == 2 * N * H * 2
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


def test_lora_dropout_copies_and_what_dropout_0_saves():
    """Per adapted linear with ``in`` inputs: CUDA with bf16 autocast keeps a bool mask and a bf16 copy
    (3 B), fp32 without autocast (5 B); a CPU keeps fp32 noise and the fp32 copy (8 B). Dropout 0 drops
    the mask; on fp32 activations without autocast, the copy too."""
    assert plan.adapter_bytes(100, 8, 0.05, 2, "cuda", True) == (100 * 3 + 8 * 2, False)
    assert plan.adapter_bytes(100, 8, 0.05, 2, "cuda", False) == (100 * 5 + 8 * 4, False)
    assert plan.adapter_bytes(100, 8, 0.05, 4, "cpu", False) == (100 * 8 + 8 * 4, False)
    assert plan.adapter_bytes(100, 8, 0.0, 2, "cuda", True) == (100 * 2 + 8 * 2, False)
    assert plan.adapter_bytes(100, 8, 0.0, 4, "cpu", False) == (8 * 4, True)  # lora_A reads x itself
    kw = dict(use_peft=True, model_dtype="bfloat16", gradient_checkpointing=True)
    p05, p0 = plan.plan("Qwen3-8B", 131072, **kw), plan.plan("Qwen3-8B", 131072, lora_dropout=0.0, **kw)
    lora = lambda p: p.terms["layer: LoRA inputs (attention)"] + p.terms["layer: LoRA inputs (MLP)"]  # noqa: E731
    ins = sum(plan.load_shape("Qwen3-8B").linears()[n][0] for n in plan.LINEAR_NAMES)
    assert lora(p05) - lora(p0) == 131072 * ins * 1  # the masks, 1 B an input per adapter


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
    assert plan.plan("Qwen2.5-1.5B", edge, **settings).peak <= budget < plan.plan("Qwen2.5-1.5B", edge + 1, **settings).peak
    assert plan.plan("Qwen2.5-1.5B", 1024, gpu_memory=2**20, **settings).largest_tokens == 0  # the weights alone do not fit


def test_terms_scale_as_their_rules_say():
    a = plan.plan("Qwen2.5-0.5B", 4096, gradient_checkpointing=False, bf16=False)
    b = plan.plan("Qwen2.5-0.5B", 8192, gradient_checkpointing=False, bf16=False)
    assert b.terms["rollout KV cache"] == 2 * a.terms["rollout KV cache"]
    for name in ("saved by the other layers", "layer: attention", "layer: MLP", "attention workspace", "edges"):
        assert b.terms[name] == 2 * a.terms[name], name  # linear in tokens (no [N, N] attention)
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
    (["--activation-offload"], "--activation-offload"), (["--activation-offload", "yes"], "unrecognized arguments: yes"),
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
                             (dict(activation_offload=True), ValueError, "activation_offload"),
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
    main(["plan", "--model", "Qwen3-8B", "--tokens", "131072", "--use-peft", "--model-dtype", "bfloat16",
          "--gradient-checkpointing", "--mlp-chunk-tokens", "4096", "--gpu-memory", "80GB"])  # (no offload)
    assert "(99% of it: under 5% left for the CUDA context" in capsys.readouterr().out
    main(["plan", "--model", "Qwen2.5-1.5B", "--tokens", "32768", "--gpu-memory", "24GB", "--json"])
    result = json.loads(capsys.readouterr().out)
    assert result["fits"] is False and result["largest_tokens"] < 32768 and result["host_bytes"] == {}
