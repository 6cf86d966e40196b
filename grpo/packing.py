"""Padding-free GRPO micro-batches: whole sequences packed into rows, micro-batches by a token budget.

The trainer pads every completion of a step to the step's longest and its prompts to the longest
prompt; for reasoning-length completions most of the tokens and most of the attention FLOPs are then
padding. Here each micro-batch is instead **one packed row** ``[1, L]`` of whole sequences (prompt +
completion, no padding), with

- ``position_ids`` restarting at 0 for every sequence (so RoPE sees each sequence as if alone);
- ``segment_ids`` (0, 1, ... one id per sequence, in packing order): the contract-v2 argument of the
  loss (``grpo_kernels.grpo_loss(..., segment_ids=)``) for its per-sequence quantities;
- the loss inputs laid out on the predicting positions: position ``i`` of a sequence predicts its token
  ``i + 1``, so a completion token ``t`` of a sequence with ``p`` prompt tokens is the target of
  position ``p - 1 + t``; the last position of a sequence predicts nothing (target ``-100``, mask 0),
  nor does any prompt position but the last. ``completion_ids``, ``loss_mask``, per-token
  ``advantages``, ``old_logps`` and ``ref_logps`` are ``[1, L]`` in that layout, so the hidden states
  ``[1, L, H]`` of the packed forward go straight into ``fused_linear_grpo_loss`` (no shift, no slice).

Micro-batches (:func:`plan_micro_batches`) are filled first-fit decreasing: sequences longest first,
each into the first micro-batch whose total stays within ``max_tokens_per_microbatch``. A sequence
longer than the budget gets a micro-batch of its own (it cannot be split: its tokens attend to each
other); that micro-batch is the only one over the budget.

Attention stays within each sequence (:func:`packed_forward`):

- ``flash_attention_2`` / ``flash_attention_3`` (GPU): flash-attn's variable-length kernel, through
  transformers' packed-sequence support: ``position_ids`` plus the ``cu_seq_lens_q/k`` and
  ``max_length_q/k`` keywords (``FlashAttentionKwargs``), which transformers passes to
  ``flash_attn_varlen_func``. Cost ``sum_i l_i^2``, no mask.
- ``"packed_sdpa"`` (:data:`PACKED_SDPA`, registered here with transformers' ``AttentionInterface``;
  CPU or GPU): PyTorch SDPA once per sequence with ``is_causal=True`` (exact, no mask, cost
  ``sum_i l_i^2``). Given no ``cu_seq_lens_q`` (generation, padded batches) it is transformers' ``sdpa``.
- ``"sdpa"`` / ``"eager"``: transformers 5 detects the restarting ``position_ids`` when no attention
  mask is given (``masking_utils.find_packed_sequence_indices``) and builds a block-diagonal causal
  mask: exact as well, but the ``[L, L]`` mask is materialised and attention costs ``L^2``.

What packing costs: building the layouts is a Python loop over the sequences (small against the
step); ``packed_sdpa`` makes one SDPA call per sequence per layer, whose fixed cost on a CPU is large,
so there its gain is memory (no ``[L, L]`` mask) and ``sum l_i^2`` scaling for long sequences, not
speed on short ones. The step's saving is elsewhere: no model FLOPs, no attention and no micro-batch
overhead spent on padding. The measurements: benchmarks/results/cpu-20261130-packing_cost.md.

The loss normalisers equal the padded run's because they are computed once per step over all
sequences, never per micro-batch: dapo divides by ``num_items_in_batch``, the loss tokens of the whole
step (the trainer's ``batch_totals``); grpo and dr_grpo reduce per sequence with ``segment_ids``
and the trainer scales a micro-batch's loss by ``mb.sequences_in_loss / batch_size`` (the sequences
with a loss token in this micro-batch, as the loss counts them, over the step's sequences; a
sequence without loss tokens adds 0, as a padded empty row does, and is counted in ``batch_size``
as the padded ``B`` counts it), as it does for padded micro-batches (``grpo.trainer.loss_normalisation``).
verl's ``loss_mode`` gets the step's counts as keywords instead (``global_batch_size``).

Shapes: ``B`` sequences in the step, ``P`` prompt positions (left padded), ``T`` completion positions
(right padded), ``L`` tokens in a packed row, ``n`` sequences in it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence, Union

import torch
import torch.nn.functional as F

from grpo_kernels import SamplingMask
from grpo_kernels.options import IGNORE_INDEX

PACKED_SDPA = "packed_sdpa"  # attn_implementation name of :func:`packed_sdpa_attention`
FLASH_IMPLEMENTATIONS = ("flash_attention_2", "flash_attention_3")
MASKED_IMPLEMENTATIONS = ("sdpa", "eager")  # exact through transformers' packed-mask detection, O(L^2)
PACKED_IMPLEMENTATIONS = (*FLASH_IMPLEMENTATIONS, PACKED_SDPA, *MASKED_IMPLEMENTATIONS)


# --------------------------------------------------------------------------------------------------
# micro-batches by a token budget
# --------------------------------------------------------------------------------------------------
def plan_micro_batches(lengths: Union[Sequence[int], torch.Tensor], max_tokens: Optional[int]) -> list[list[int]]:
    """First-fit decreasing: the indices of ``lengths`` grouped into micro-batches of at most ``max_tokens`` tokens.

    ``lengths``: tokens of each sequence (prompt + completion). Sequences are taken longest first (ties
    by index) and each goes into the first micro-batch it fits in, else opens a new one; so every
    index appears exactly once, and each micro-batch lists its sequences longest first. A sequence
    longer than ``max_tokens`` gets a micro-batch of its own. ``max_tokens=None``: one micro-batch
    with everything. Returns ``[]`` for no sequences.
    """
    lengths = [int(n) for n in (lengths.tolist() if isinstance(lengths, torch.Tensor) else lengths)]
    if any(n < 0 for n in lengths):
        raise ValueError(f"lengths must be >= 0, got {min(lengths)}")
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1):
        raise ValueError(f"max_tokens_per_microbatch must be a positive int or None, got {max_tokens!r}")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    if max_tokens is None:
        return [order] if order else []
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in order:
        n = lengths[i]
        for b, load in enumerate(loads):
            if load + n <= max_tokens:
                bins[b].append(i)
                loads[b] += n
                break
        else:
            bins.append([i])
            loads.append(n)
    return bins


# --------------------------------------------------------------------------------------------------
# one packed row
# --------------------------------------------------------------------------------------------------
@dataclass
class PackedLayout:
    """Where the sequences ``rows`` of a padded batch sit in one packed row ``[1, L]``.

    ``source`` maps each packed position to the completion position it predicts, as the flat index
    ``b * T + t`` into the padded ``[B, T]`` completion layout (``-1``: predicts no completion token).
    ``pack`` / ``unpack`` move per-completion-token values between the two layouts.
    """

    rows: torch.Tensor  # [n] long: padded-batch row of each sequence, in packing order (segment k is row rows[k])
    input_ids: torch.Tensor  # [1, L] prompt + completion tokens of each sequence, back to back
    position_ids: torch.Tensor  # [1, L] long, 0 at the start of every sequence
    segment_ids: torch.Tensor  # [1, L] long, k on the tokens of the k-th sequence
    cu_seq_lens: torch.Tensor  # [n + 1] int32: sequence k is tokens cu_seq_lens[k] : cu_seq_lens[k + 1]
    max_length: int  # longest sequence in the row
    source: torch.Tensor  # [1, L] long: b * T + t of the completion token predicted here, else -1
    completion_shape: tuple[int, int]  # (B, T) of the padded completion layout

    def __len__(self) -> int:
        return self.rows.numel()

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[1]

    @property
    def is_target(self) -> torch.Tensor:
        """[1, L] bool: positions that predict a completion token."""
        return self.source >= 0

    def pack(self, values: torch.Tensor, fill: Union[int, float] = 0) -> torch.Tensor:
        """Per-completion-token ``values`` [B, T] (or per-sequence [B], broadcast over tokens) -> [1, L].

        Positions that predict no completion token get ``fill``; values of rows not in this layout and
        of padded positions are never read.
        """
        B, T = self.completion_shape
        if values.dim() == 1:
            if values.shape[0] != B:
                raise ValueError(f"per-sequence values must have shape [{B}], got {list(values.shape)}")
            values = values.unsqueeze(-1).expand(B, T)
        if tuple(values.shape) != (B, T):
            raise ValueError(f"values must have shape [{B}, {T}] or [{B}], got {list(values.shape)}")
        src = self.source.to(values.device)
        picked = values.reshape(-1).index_select(0, src.clamp(min=0).reshape(-1)).view(src.shape)
        return torch.where(src >= 0, picked, torch.full((), fill, dtype=values.dtype, device=values.device))

    def pack_sets(self, sets: SamplingMask) -> SamplingMask:
        """Kept sets of the padded layout (``B * T``, row-major over [B, T]) -> the ``L`` sets of this row, one
        per packed position (the set of the completion token it predicts; empty where it predicts none)."""
        B, T = self.completion_shape
        if sets.num_positions != B * T:
            raise ValueError(f"sets must hold {B * T} sets (one per position of [{B}, {T}]), got {sets.num_positions}")
        with_empty = SamplingMask(sets.token_ids, torch.cat([sets.offsets, sets.offsets[-1:]]))  # an empty set at B * T
        source = self.source.reshape(-1).to(sets.offsets.device)
        return with_empty.rows(torch.where(source >= 0, source, B * T))

    def unpack(self, values: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Packed per-token ``values`` [1, L] -> the padded layout [B, T], into ``out`` (default zeros).

        Only the completion positions of this layout's rows are written; positions predicting nothing
        are not read. Unpacking every micro-batch of a step into one ``out`` rebuilds the whole batch.
        """
        if tuple(values.shape) != (1, self.num_tokens):
            raise ValueError(f"values must have shape [1, {self.num_tokens}], got {list(values.shape)}")
        B, T = self.completion_shape
        if out is None:
            out = values.new_zeros((B, T))
        keep = self.is_target.reshape(-1).to(values.device)
        flat = out.view(-1)  # (out must be contiguous [B, T])
        flat.index_copy_(0, self.source.reshape(-1).to(values.device)[keep], values.reshape(-1)[keep].to(out.dtype))
        return out


def sequence_spans(attention_mask: torch.Tensor, prompt_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(prompt tokens [B], completion tokens [B]) of a padded batch, checked to be packable.

    ``attention_mask`` [B, P + T]: 1 on real tokens; the first ``prompt_len`` columns are the prompt
    (any padding), the rest the completion, whose real tokens must come first (right padding). Every
    sequence with a completion needs a prompt token, which predicts the first completion token.
    """
    if attention_mask.dim() != 2 or not 0 <= prompt_len <= attention_mask.shape[1]:
        raise ValueError(f"attention_mask must be [B, P+T] with P = prompt_len = {prompt_len}, got {list(attention_mask.shape)}")
    valid = attention_mask != 0
    prompt_lens = valid[:, :prompt_len].sum(-1)
    completion = valid[:, prompt_len:]
    completion_lens = completion.sum(-1)
    T = completion.shape[1]
    prefix = torch.arange(T, device=completion.device) < completion_lens.unsqueeze(-1)
    if not torch.equal(completion, prefix):
        raise ValueError("attention_mask: completion tokens must be right-padded (real tokens first)")
    if bool(((prompt_lens == 0) & (completion_lens > 0)).any()):
        raise ValueError("attention_mask: a sequence with completion tokens has no prompt token to predict the first one")
    return prompt_lens, completion_lens


def pack_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_len: int,
              rows: Sequence[int]) -> PackedLayout:
    """The packed layout of sequences ``rows`` of a padded batch (``input_ids`` [B, P + T], prompt then completion)."""
    prompt_lens, completion_lens = sequence_spans(attention_mask, prompt_len)
    B, S = input_ids.shape
    T = S - prompt_len
    device = input_ids.device
    rows_t = torch.as_tensor(list(rows), dtype=torch.long, device=device)
    if rows_t.numel() == 0:
        raise ValueError("rows: a packed row needs at least one sequence")
    if int(rows_t.min()) < 0 or int(rows_t.max()) >= B or rows_t.unique().numel() != rows_t.numel():
        raise ValueError(f"rows must be distinct indices in [0, {B}), got {list(rows)}")
    ids, pos, seg, src, lens = [], [], [], [], []
    valid = attention_mask != 0
    for k, b in enumerate(rows_t.tolist()):
        p, c = int(prompt_lens[b]), int(completion_lens[b])
        tokens = input_ids[b][valid[b]]  # [p + c]
        n = p + c
        # position j predicts token j + 1, which is completion token j + 1 - p when j >= p - 1
        j = torch.arange(n, device=device)
        t = j + 1 - p
        src.append(torch.where((t >= 0) & (t < c), b * T + t, torch.full_like(j, -1)))
        ids.append(tokens)
        pos.append(j)
        seg.append(torch.full_like(j, k))
        lens.append(n)
    cu = torch.zeros(len(lens) + 1, dtype=torch.int32, device=device)
    cu[1:] = torch.cumsum(torch.tensor(lens, dtype=torch.int32, device=device), 0)
    return PackedLayout(
        rows=rows_t, input_ids=torch.cat(ids).unsqueeze(0), position_ids=torch.cat(pos).unsqueeze(0),
        segment_ids=torch.cat(seg).unsqueeze(0), cu_seq_lens=cu, max_length=max(lens),
        source=torch.cat(src).unsqueeze(0), completion_shape=(B, T),
    )


# --------------------------------------------------------------------------------------------------
# a step's micro-batches, in the trainer's terms
# --------------------------------------------------------------------------------------------------
@dataclass
class PackedMicroBatch:
    """One micro-batch as one packed row: what the loss needs, named as the trainer's ``UpdateBatch`` names it.

    Every tensor is ``[1, L]`` on the predicting positions (see the module docstring). ``len(mb)`` is
    the number of sequences, as ``len`` of a padded micro-batch is its number of rows.
    """

    layout: PackedLayout
    completion_ids: torch.Tensor  # [1, L] long: the token each position predicts, -100 where none
    loss_mask: torch.Tensor  # [1, L]: the step's loss mask on the predicting positions, 0 elsewhere
    advantages: torch.Tensor  # [1, L] float32, per token
    old_logps: Optional[torch.Tensor] = None  # [1, L] float32
    ref_logps: Optional[torch.Tensor] = None  # [1, L] float32
    rollout_logps: Optional[torch.Tensor] = None  # [1, L] float32
    sampling_mask: Optional[SamplingMask] = None  # L kept sets, one per position (PackedLayout.pack_sets)

    def __len__(self) -> int:
        return len(self.layout)

    @property
    def sequences_in_loss(self) -> int:
        """The sequences a call's per-sequence reduction divides by: those with a loss token (as
        ``grpo_kernels`` counts them among the mask-1 positions of ``segment_ids``)."""
        return int(torch.unique(self.segment_ids[self.loss_mask != 0]).numel())

    @property
    def segment_ids(self) -> torch.Tensor:
        return self.layout.segment_ids

    @property
    def num_tokens(self) -> int:
        return self.layout.num_tokens


def pack_batch(batch: Any, max_tokens: Optional[int]) -> list[PackedMicroBatch]:
    """A padded update batch as packed micro-batches of at most ``max_tokens`` tokens each (oversize sequences alone).

    ``batch`` has the fields of the trainer's ``UpdateBatch``: ``input_ids`` / ``attention_mask``
    [B, P + T], ``prompt_len`` P, ``completion_ids`` / ``loss_mask`` [B, T], ``advantages`` [B] or
    [B, T], and optional ``old_logps`` / ``ref_logps`` / ``rollout_logps`` [B, T] (packed when present, so they can be
    computed before or after packing: see :func:`unpack_values`) and ``sampling_mask`` (``B * T`` kept sets).
    """
    prompt_lens, completion_lens = sequence_spans(batch.attention_mask, batch.prompt_len)
    loss_mask = batch.loss_mask
    T = batch.completion_ids.shape[1]
    outside = (loss_mask != 0) & ~(torch.arange(T, device=loss_mask.device) < completion_lens.unsqueeze(-1).to(loss_mask.device))
    if bool(outside.any()):
        raise ValueError("loss_mask is on where attention_mask has no completion token")
    plan = plan_micro_batches(prompt_lens + completion_lens, max_tokens)
    out = []
    for rows in plan:
        layout = pack_rows(batch.input_ids, batch.attention_mask, batch.prompt_len, rows)
        optional = lambda t: None if t is None else layout.pack(t.float())  # noqa: E731
        out.append(PackedMicroBatch(
            layout=layout,
            completion_ids=layout.pack(batch.completion_ids, fill=IGNORE_INDEX),
            loss_mask=layout.pack(loss_mask),
            advantages=layout.pack(batch.advantages.float()),
            old_logps=optional(getattr(batch, "old_logps", None)),
            ref_logps=optional(getattr(batch, "ref_logps", None)),
            rollout_logps=optional(getattr(batch, "rollout_logps", None)),
            sampling_mask=None if getattr(batch, "sampling_mask", None) is None else layout.pack_sets(batch.sampling_mask),
        ))
    return out


def filler_micro_batch(batch: Any) -> PackedMicroBatch:
    """A one-token packed row that adds nothing: no sequence (``len`` 0), no loss token, advantage 0.

    ``batch``: the padded update batch (as for :func:`pack_batch`; it may have no rows). Under FSDP2
    every forward gathers weights, so every rank must make as many calls as the rank with the most
    micro-batches: the others append fillers (as the trainer's ``UpdateBatch.filler``).
    """
    device = batch.input_ids.device
    one = lambda fill, dtype: torch.full((1, 1), fill, dtype=dtype, device=device)  # noqa: E731
    layout = PackedLayout(
        rows=torch.zeros(0, dtype=torch.long, device=device), input_ids=one(0, torch.long),
        position_ids=one(0, torch.long), segment_ids=one(0, torch.long),
        cu_seq_lens=torch.tensor([0, 1], dtype=torch.int32, device=device), max_length=1,
        source=one(-1, torch.long), completion_shape=tuple(batch.completion_ids.shape),
    )
    optional = lambda t: None if t is None else one(0, torch.float32)  # noqa: E731
    sets = getattr(batch, "sampling_mask", None)
    return PackedMicroBatch(layout, one(IGNORE_INDEX, torch.long), one(0, batch.loss_mask.dtype), one(0, torch.float32),
                            optional(getattr(batch, "old_logps", None)), optional(getattr(batch, "ref_logps", None)),
                            optional(getattr(batch, "rollout_logps", None)),
                            None if sets is None else SamplingMask(sets.token_ids[:0], sets.offsets.new_zeros(2)))


def unpack_values(micro_batches: Sequence[PackedMicroBatch], values: Sequence[torch.Tensor]) -> torch.Tensor:
    """Per-token ``values`` [1, L] of each micro-batch -> one padded [B, T] tensor for the whole step (0 elsewhere).

    E.g. the old-policy log-probs of every packed row, back in the layout of ``batch.old_logps``.
    """
    if len(micro_batches) != len(values) or not micro_batches:
        raise ValueError(f"need one values tensor per micro-batch, got {len(values)} for {len(micro_batches)}")
    first = values[0]
    out = first.new_zeros(micro_batches[0].layout.completion_shape)
    for mb, v in zip(micro_batches, values):
        mb.layout.unpack(v, out)
    return out


# --------------------------------------------------------------------------------------------------
# attention within each sequence
# --------------------------------------------------------------------------------------------------
def packed_sdpa_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    cu_seq_lens_q: Optional[torch.Tensor] = None,
    cu_seq_lens_k: Optional[torch.Tensor] = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Causal SDPA run once per packed sequence: exact for packed rows, no [L, L] mask, ``sum l_i^2`` work.

    A transformers attention function (``AttentionInterface``): query [1, heads, L, d], key/value
    [1, kv_heads, L, d] -> ([1, L, heads, d], None). The sequences are given by ``cu_seq_lens_q``
    (int [n + 1], the ``FlashAttentionKwargs`` name, passed by :func:`packed_forward`). Without it
    (generation, padded batches) this is transformers' ``sdpa`` with whatever mask the model built.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if cu_seq_lens_q is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    if query.shape[0] != 1 or attention_mask is not None:
        raise ValueError("packed_sdpa: packed rows come one per call ([1, heads, L, d]) with no attention mask")
    if cu_seq_lens_k is not None and not torch.equal(cu_seq_lens_k, cu_seq_lens_q):
        raise ValueError("packed_sdpa: cu_seq_lens_k must equal cu_seq_lens_q (self-attention, no cache)")
    if int(cu_seq_lens_q[-1]) != query.shape[2]:
        raise ValueError(f"packed_sdpa: cu_seq_lens_q ends at {int(cu_seq_lens_q[-1])}, the row has {query.shape[2]} tokens")
    gqa = query.shape[1] != key.shape[1]
    bounds = cu_seq_lens_q.tolist()
    outs = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        outs.append(F.scaled_dot_product_attention(
            query[:, :, start:end], key[:, :, start:end], value[:, :, start:end],
            dropout_p=dropout, scale=scaling, is_causal=True, enable_gqa=gqa,
        ))
    return torch.cat(outs, dim=2).transpose(1, 2).contiguous(), None


def register_packed_attention() -> None:
    """Register :data:`PACKED_SDPA` with transformers (idempotent).

    The attention function is :func:`packed_sdpa_attention`; its mask function is ``sdpa``'s, so a
    model set to it still generates and runs padded batches as ``sdpa`` does.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(PACKED_SDPA, packed_sdpa_attention)
    AttentionMaskInterface.register(PACKED_SDPA, sdpa_mask)


def use_packed_attention(model: torch.nn.Module) -> str:
    """Give ``model`` an attention implementation that is exact for packed rows and return its name.

    Flash attention (GPU) is kept as it is (variable-length path); anything else becomes
    :data:`PACKED_SDPA`.
    """
    config = model.config
    if config._attn_implementation in FLASH_IMPLEMENTATIONS or config._attn_implementation == PACKED_SDPA:
        return config._attn_implementation
    register_packed_attention()
    model.set_attn_implementation(PACKED_SDPA)
    return PACKED_SDPA


def packed_forward_kwargs(model: torch.nn.Module, layout: PackedLayout) -> dict[str, Any]:
    """Keyword arguments of the base model's forward for one packed row, for the model's attention implementation."""
    config = model.config
    impl = config._attn_implementation
    if impl not in PACKED_IMPLEMENTATIONS:
        raise ValueError(
            f"attn_implementation {impl!r} is not known to keep packed sequences apart; use one of {PACKED_IMPLEMENTATIONS} "
            "(grpo.packing.use_packed_attention(model) picks one)"
        )
    kwargs: dict[str, Any] = dict(input_ids=layout.input_ids, position_ids=layout.position_ids, use_cache=False)
    if impl in MASKED_IMPLEMENTATIONS:  # transformers detects the restarts and builds the block-diagonal mask
        return kwargs
    cu = layout.cu_seq_lens.to(layout.input_ids.device)
    kwargs.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=layout.max_length, max_length_k=layout.max_length)
    if impl == PACKED_SDPA:  # a ready mapping skips mask creation: no [L, L] mask is ever built
        kwargs["attention_mask"] = {kind: None for kind in set(getattr(config, "layer_types", None) or ["full_attention"])}
    return kwargs


def packed_forward(model: torch.nn.Module, layout: PackedLayout) -> torch.Tensor:
    """Last hidden states [1, L, H] (final norm applied) of the base model on one packed row.

    ``model`` is a transformers causal LM; ``hidden[:, i]`` predicts ``layout``'s target at ``i``.
    """
    return model.base_model(**packed_forward_kwargs(model, layout)).last_hidden_state
