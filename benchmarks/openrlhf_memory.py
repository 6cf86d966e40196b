"""OpenRLHF's Actor, patched by grpo_kernels.integrations.openrlhf or not: peak memory and time of one PPO step.

One forward + backward of the PPO actor loss as OpenRLHF's ``ppo_actor.py`` builds it (``Actor.forward``
with ``action_mask``, ``return_output`` and ``return_entropy``; OpenRLHF's ``PolicyLoss`` and an entropy
bonus through its ``aggregate_loss``), on a Qwen2 built in code and loaded by ``openrlhf.models.Actor``
(SDPA attention, the model dtype given). Sides: ``openrlhf`` (its own forward: the ``[B, S, V]`` logits in
fp32, and their copies for the log-softmax and the entropy) and ``grpo-kernels`` (the patched forward:
the logits a chunk of rows at a time). Peak: the most bytes held above what existed before the step
(``harness.peak_extra_bytes``: torch.cuda's counters on a GPU, the profiler's memory events on a CPU).
Runs in the venv that has OpenRLHF (``make install-openrlhf``: ``.venv-openrlhf/bin/python -m
benchmarks.openrlhf_memory``). A benchmark, not a test: nothing is asserted.
"""

from __future__ import annotations

import sys
import tempfile
from typing import Dict

import torch

from benchmarks import harness as H

SIDES = ("openrlhf", "grpo-kernels")


def build_actor(folder: str, vocab: int, hidden: int, layers: int, seq: int, dtype: torch.dtype):
    import transformers
    from openrlhf.models import Actor

    cfg = transformers.Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                                   num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=seq, tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.Qwen2ForCausalLM(cfg).save_pretrained(folder)
    return Actor(folder, attn_implementation="sdpa", param_dtype="bf16", temperature=0.7).to(dtype)


def step(actor, batch) -> None:
    from openrlhf.models import PolicyLoss, aggregate_loss

    sequences, attention_mask, action_mask, old, advantages = batch
    actor.zero_grad(set_to_none=True)
    log_probs, output = actor(sequences, action_mask, attention_mask=attention_mask, return_output=True,
                              return_entropy=True)
    loss = PolicyLoss()(log_probs, old, advantages, action_mask=action_mask)[0]
    loss = loss - 0.01 * aggregate_loss(output.entropy[:, -action_mask.shape[1]:], action_mask)
    loss.backward()


def make_batch(b: int, s: int, vocab: int):
    g = torch.Generator().manual_seed(1)
    a = s // 2
    sequences = torch.randint(0, vocab, (b, s), generator=g)
    return (sequences, torch.ones(b, s, dtype=torch.long), torch.ones(b, a, dtype=torch.bool),
            -torch.rand(b, a, generator=g) * 4, torch.randn(b, a, generator=g))


def main(argv=None) -> int:
    a = H.parser(__doc__.splitlines()[0], rounds=3, batch=1, seq=2048, vocab=32000, hidden=128, layers=2,
                 dtype=("bf16", "model and head dtype", ["fp32", "bf16"])).parse_args(argv)
    from grpo_kernels.integrations import openrlhf as gk

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[a.dtype]
    batch = make_batch(a.batch, a.seq, a.vocab)
    report = H.Report("OpenRLHF Actor: one PPO step's peak memory, patched or not",
                      H.conditions(openrlhf=H.version("openrlhf")))
    with tempfile.TemporaryDirectory() as folder:
        actor = build_actor(folder, a.vocab, a.hidden, a.layers, a.seq, dtype)
        peaks: Dict[str, int] = {}
        times: Dict[str, list] = {}
        for side in SIDES:
            (gk.patch if side == "grpo-kernels" else gk.unpatch)()
            step(actor, batch)  # warm-up (and OpenRLHF's torch.compile of its entropy)
            peaks[side], method = H.peak_extra_bytes(lambda: step(actor, batch), torch.device("cpu"))
            times[side] = [H.timed(lambda: step(actor, batch)) for _ in range(a.rounds)]
            report.records.append(dict(side=side, batch=a.batch, seq=a.seq, vocab=a.vocab, hidden=a.hidden,
                                       layers=a.layers, dtype=a.dtype, peak_bytes=peaks[side], method=method,
                                       seconds=times[side]))
        gk.unpatch()
    logits = a.batch * a.seq * a.vocab * 4
    report.add(f"B = {a.batch}, S = {a.seq} (A = {a.seq // 2} scored), V = {a.vocab:,}, H = {a.hidden}, "
               f"{a.layers} layers, {a.dtype}, temperature 0.7; fp32 [B, S, V] logits: {H.fmt_bytes(logits)}. "
               f"Peak: {method}; time: median of {a.rounds} steps.", "",
               *H.table(("side", "peak above the start", "x logits", "time (median)"),
                        [(s, H.fmt_bytes(peaks[s]), f"{peaks[s] / logits:.2f}", H.fmt_time(H.median(times[s])))
                         for s in SIDES]), "")
    report.write(a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
