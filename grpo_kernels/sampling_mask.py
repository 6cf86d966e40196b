"""The rollout engine's kept sets, one per target position, for sampling-mask replay (API.md contract v5).

A sampler that truncates (top-k, top-p, min-p, ...) draws each token from ``softmax(z)`` restricted to a
set ``S_i`` of kept ids. Replaying that set in the loss gives the log-prob the engine actually sampled
from, ``log p_i = z_{t_i} - logsumexp_{j in S_i} z_j`` (the truncated-sampling correction of e.g. "Your
Efficient RL Framework Secretly Brings You Off-Policy RL Training", Yao et al. 2025), without
re-deriving the set from the trainer's logits (which differ slightly from the engine's and so can keep
a different set).

:class:`SamplingMask` holds the sets in CSR form: ``token_ids [K]`` (global vocabulary ids) and
``offsets [N + 1]`` int64, position ``i`` of the targets in row-major order owning
``token_ids[offsets[i]:offsets[i + 1]]``. A position without a target (masked, or ``ignore_index``) may
own an empty set.
"""

from __future__ import annotations

import itertools
import numbers
from dataclasses import dataclass
from typing import Any, Iterable, List, Optional, Sequence, Union

import numpy as np
import torch

_ID_DTYPES = (torch.int32, torch.int64)


def _shape(t: torch.Tensor) -> str:
    return "[" + ", ".join(str(s) for s in t.shape) + "]"


def _same_device(a: torch.device, b: torch.device) -> bool:
    """``cuda`` and ``cuda:0`` are one device when the index is left out."""
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


def _is_id(x: object) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, (bool, np.bool_))


def _as_list(x: object, where: str) -> list:
    """A nested-list node as a Python list (a tensor / array becomes its ``tolist()``)."""
    if isinstance(x, (torch.Tensor, np.ndarray)):
        x = x.tolist()
        return x if isinstance(x, list) else [x]
    if isinstance(x, (list, tuple)):
        return list(x)
    if isinstance(x, (str, bytes)) or not isinstance(x, Sequence):
        raise TypeError(f"{where} must be a list of token ids (or a list of such lists), got {type(x).__name__}")
    return list(x)


def _nesting(node: list, level: int, where: str, set_levels: set, empty_levels: set) -> None:
    """Record the levels at which ``node``'s sets (lists of ids) and empty lists sit."""
    if not node:
        empty_levels.add(level)
        return
    ids = [_is_id(x) for x in node]
    if all(ids):
        set_levels.add(level)
        return
    if any(ids):
        raise ValueError(f"{where} mixes token ids and nested lists at one level")
    for i, child in enumerate(node):
        _nesting(_as_list(child, f"{where}[{i}]"), level + 1, f"{where}[{i}]", set_levels, empty_levels)


def _dims(node: list, level: int, depth: int, dims: List[int]) -> None:
    """The longest length at each container level (ragged lists are padded to it)."""
    if level == depth:
        return
    dims[level] = max(dims[level], len(node))
    for child in node:
        _dims(_as_list(child, "sets"), level + 1, depth, dims)


def _flatten(node: list, level: int, depth: int, dims: List[int], out: List[list]) -> None:
    """The sets below ``node`` in row-major order, each container padded with empty sets to ``dims``."""
    if level == depth:
        out.append(node)
        return
    for child in node:
        _flatten(_as_list(child, "sets"), level + 1, depth, dims, out)
    pad = dims[level] - len(node)
    if pad:
        out.extend([] for _ in range(pad * int(np.prod(dims[level + 1:depth], dtype=np.int64))))


def _from_sets(sets: Iterable[Sequence[int]], device: Optional[Union[str, torch.device]]) -> "SamplingMask":
    sets = list(sets)
    sizes = [len(s) for s in sets]
    ids = list(itertools.chain.from_iterable(sets))
    for x in ids:  # a float / bool id would be truncated silently by torch.tensor
        if not _is_id(x):
            raise TypeError(f"sampling_mask sets must hold int token ids, got {type(x).__name__} {x!r}")
    offsets = torch.zeros(len(sizes) + 1, dtype=torch.int64)
    if sizes:
        torch.cumsum(torch.tensor(sizes, dtype=torch.int64), 0, out=offsets[1:])
    token_ids = torch.tensor(ids, dtype=torch.int64) if ids else torch.zeros(0, dtype=torch.int64)
    return SamplingMask(token_ids.to(device), offsets.to(device))


# Elements of the [rows, V] bitmap one block of the duplicate check marks (16 MiB of bools).
_BITMAP_ELEMENTS = 1 << 24


def _sorted_repeat(token_ids: torch.Tensor, sizes: torch.Tensor, vocab_size: int):
    """:func:`_first_repeat` by sorting the ``position * V + id`` keys."""
    row_of = torch.repeat_interleave(torch.arange(sizes.numel(), device=sizes.device), sizes,
                                     output_size=token_ids.numel())
    key, _ = torch.sort(row_of * vocab_size + token_ids)
    dup = key[1:] == key[:-1]
    if not bool(dup.any()):
        return None
    at = int(key[1:][dup][0])
    return at // vocab_size, at % vocab_size


def _first_repeat(token_ids: torch.Tensor, offsets: torch.Tensor, sizes: torch.Tensor, vocab_size: int):
    """(position, id) of an id repeated within one set, or None. Few entries per position (``K`` well under
    ``N V / 8``): sort the ``(position, id)`` keys, a repeat is two equal neighbours (``O(K log K)``). Large
    sets: mark each block of positions' ids in a ``[rows, V]`` bitmap, a repeat marks fewer cells than
    entries (``O(K + N V)``, no sort of millions of keys)."""
    n, k = sizes.numel(), token_ids.numel()
    if k * 8 < n * vocab_size:
        return _sorted_repeat(token_ids, sizes, vocab_size)
    rows_per_block = max(1, _BITMAP_ELEMENTS // vocab_size)
    bounds = offsets.tolist()
    start = 0
    while start < n:  # blocks of at most rows_per_block positions and _BITMAP_ELEMENTS / 8 entries (or one position)
        stop = start + 1
        while (stop < n and stop - start < rows_per_block
               and bounds[stop + 1] - bounds[start] <= _BITMAP_ELEMENTS // 8):
            stop += 1
        lo, hi = bounds[start], bounds[stop]
        seen = torch.zeros(stop - start, vocab_size, dtype=torch.bool, device=offsets.device)
        if token_ids.device.type == "cpu":  # each position's ids into its own row (no per-entry temporary)
            for r in range(start, stop):
                seen[r - start].index_fill_(0, token_ids[bounds[r]:bounds[r + 1]], True)
        else:  # (one launch: each entry's cell of the flattened bitmap, its row times V plus its id)
            cells = torch.repeat_interleave(torch.arange(stop - start, device=offsets.device) * vocab_size,
                                            sizes[start:stop], output_size=hi - lo).add_(token_ids[lo:hi])
            seen.view(-1).index_fill_(0, cells, True)
        if int(seen.sum()) != hi - lo:  # a repeat: find it among this block's keys
            found = _sorted_repeat(token_ids[lo:hi], sizes[start:stop], vocab_size)
            return (start + found[0], found[1]) if found is not None else None
        start = stop
    return None


@dataclass(frozen=True, eq=False)
class SamplingMask:
    """Per-token kept sets in CSR form (API.md contract v5).

    Attributes:
        token_ids: ``[K]`` int32 or int64, global vocabulary ids, the sets one after the other.
        offsets: ``[N + 1]`` int64 (int32 accepted), ``offsets[0] == 0``, non-decreasing,
            ``offsets[-1] == K``. Position ``i`` (row-major order of the targets) owns
            ``token_ids[offsets[i]:offsets[i + 1]]``.

    The sets are validated against a call (:meth:`check`) before any kernel launches: ids in
    ``[0, V)``, no duplicate within a set, ``N`` equal to the number of target positions.
    """

    token_ids: torch.Tensor
    offsets: torch.Tensor

    def __post_init__(self) -> None:
        for field in ("token_ids", "offsets"):
            value = getattr(self, field)
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"SamplingMask.{field} must be a torch.Tensor, got {type(value).__name__}")

    # ----------------------------------------------------------------------------------- constructors
    @classmethod
    def from_lists(cls, sets: Sequence[Any], *, device: Optional[Union[str, torch.device]] = None) -> "SamplingMask":
        """From nested lists shaped like the targets: ``[B][T][k]`` (or ``[N][k]``, or deeper).

        The innermost lists (or 1-D tensors / arrays) are the sets, one per position. Ragged levels are
        padded with empty sets to their longest length (a batch of completions of different lengths
        becomes ``[B, max T]``, as the targets are padded), so position ``i`` is the row-major index into
        that padded shape.
        """
        top = _as_list(sets, "sets")
        set_levels: set = set()
        empty_levels: set = set()
        _nesting(top, 0, "sets", set_levels, empty_levels)
        if len(set_levels) > 1:
            raise ValueError(f"sets must nest every set at one depth, found sets at depths {sorted(set_levels)}")
        depth = next(iter(set_levels)) if set_levels else max(empty_levels)
        if depth == 0:
            raise ValueError("sets must hold one list of kept ids per position (e.g. [B][T][k] or [N][k]), "
                             "got a single flat list of ids")
        if any(level > depth for level in empty_levels):
            raise ValueError("sets nests empty lists deeper than its sets")
        dims = [0] * depth
        _dims(top, 0, depth, dims)
        flat: List[list] = []
        _flatten(top, 0, depth, dims, flat)
        return _from_sets(flat, device)

    @classmethod
    def from_vllm(cls, outputs: Sequence[Any], T: Optional[int] = None, *,
                  device: Optional[Union[str, torch.device]] = None) -> "SamplingMask":
        """From vLLM generation outputs: a list of ``RequestOutput`` (each contributes every
        ``CompletionOutput`` in its ``.outputs``, in order: ``n > 1`` gives ``n`` sequences) and/or
        ``CompletionOutput`` (one sequence each).

        Each completion's ``.sampling_mask.token_ids`` is a list of kept-id lists, one per generated token;
        each sequence is padded with empty sets to ``T`` positions (``None``: the longest), giving the
        sets of targets shaped ``[num_completions, T]``.
        """
        completions = []
        for i, out in enumerate(_as_list(outputs, "outputs")):
            if hasattr(out, "outputs") and not hasattr(out, "sampling_mask"):
                completions.extend((f"outputs[{i}].outputs[{j}]", c) for j, c in enumerate(out.outputs))
            else:
                completions.append((f"outputs[{i}]", out))
        per_seq = []
        for where, completion in completions:
            mask = getattr(completion, "sampling_mask", None)
            if mask is None:
                raise ValueError(f"{where}.sampling_mask is None: the engine recorded no kept sets for it "
                                 f"(sample with the sampling mask enabled)")
            sets = getattr(mask, "token_ids", mask)
            per_seq.append([_as_list(s, f"{where}.sampling_mask.token_ids[{t}]") for t, s in
                            enumerate(_as_list(sets, f"{where}.sampling_mask.token_ids"))])
        longest = max((len(s) for s in per_seq), default=0)
        if T is None:
            T = longest
        elif isinstance(T, bool) or not isinstance(T, numbers.Integral) or T < 0:
            raise ValueError(f"T must be None or an int >= 0, got {T!r}")
        elif longest > T:
            raise ValueError(f"T={T} is shorter than a completion's {longest} sampled tokens")
        flat: List[list] = []
        for seq in per_seq:
            flat.extend(seq)
            flat.extend([] for _ in range(int(T) - len(seq)))
        return _from_sets(flat, device)

    # ---------------------------------------------------------------------------------------- views
    @property
    def num_positions(self) -> int:
        """``N``: the number of positions (sets)."""
        return self.offsets.numel() - 1

    @property
    def device(self) -> torch.device:
        return self.token_ids.device

    def sizes(self) -> torch.Tensor:
        """``[N]`` int64: each position's set size."""
        return (self.offsets[1:] - self.offsets[:-1]).to(torch.int64)

    def to(self, device: Union[str, torch.device]) -> "SamplingMask":
        return SamplingMask(self.token_ids.to(device), self.offsets.to(device))

    def rows(self, index: Union[torch.Tensor, slice]) -> "SamplingMask":
        """The sets of some positions: ``index`` an int64 index tensor (or a bool mask [N]) or a slice
        of step 1; the offsets rebased to 0."""
        if isinstance(index, slice):
            start, stop, step = index.indices(self.num_positions)
            if step != 1:
                raise ValueError(f"SamplingMask.rows takes a slice of step 1, got step {step}")
            stop = max(stop, start)
            offsets = self.offsets[start:stop + 1]
            lo, hi = int(offsets[0]), int(offsets[-1])
            return SamplingMask(self.token_ids[lo:hi], (offsets - lo).to(torch.int64))
        if index.dtype == torch.bool:
            index = index.nonzero().squeeze(-1)
        index = index.to(device=self.offsets.device, dtype=torch.int64).reshape(-1)
        starts = self.offsets.index_select(0, index).to(torch.int64)
        sizes = self.offsets.index_select(0, index + 1).to(torch.int64) - starts
        offsets = torch.zeros(index.numel() + 1, dtype=torch.int64, device=index.device)
        torch.cumsum(sizes, 0, out=offsets[1:])
        # entry e of the new layout, in set r: starts[r] + (e - offsets[r])
        entry = torch.arange(int(offsets[-1]), device=index.device)
        entry += torch.repeat_interleave(starts - offsets[:-1], sizes)
        return SamplingMask(self.token_ids.index_select(0, entry), offsets)

    # ----------------------------------------------------------------------------------- validation
    def check(self, name: str, num_positions: int, vocab_size: int,
              device: Optional[torch.device] = None) -> "SamplingMask":
        """Validate against a call with ``num_positions`` targets and vocabulary ``vocab_size`` (on
        ``device``, when given); -> the mask with int64 ``token_ids`` and ``offsets``.

        Raises TypeError (wrong dtypes) or ValueError (anything else) naming ``name``. Costs one device
        synchronisation and a sort of the ``K`` entries; skipped while torch.compile traces.
        """
        token_ids, offsets = self.token_ids, self.offsets
        for field, t in (("token_ids", token_ids), ("offsets", offsets)):
            if t.dtype not in _ID_DTYPES:
                raise TypeError(f"{name}.{field} must be an int32 or int64 tensor, got {t.dtype}")
            if t.dim() != 1:
                raise ValueError(f"{name}.{field} must be 1-D, got shape {_shape(t)}")
        if offsets.numel() != num_positions + 1:
            raise ValueError(f"{name} holds {offsets.numel() - 1} sets (offsets {_shape(offsets)}) but the targets have "
                             f"{num_positions} positions: it needs one set per target position, in row-major order "
                             f"(offsets of length {num_positions + 1})")
        if token_ids.device != offsets.device:
            raise ValueError(f"{name}.token_ids is on {token_ids.device} but {name}.offsets on {offsets.device}")
        if device is not None and not _same_device(torch.device(device), token_ids.device):
            raise ValueError(f"{name} is on {token_ids.device} but the call's tensors are on {device}: "
                             f"move it with {name}.to(device)")
        token_ids, offsets = token_ids.to(torch.int64), offsets.to(torch.int64)
        if torch.compiler.is_compiling():
            return SamplingMask(token_ids, offsets)
        k = token_ids.numel()
        if int(offsets[0]) != 0 or int(offsets[-1]) != k:
            raise ValueError(f"{name}.offsets must start at 0 and end at len(token_ids) = {k}, "
                             f"got {int(offsets[0])} and {int(offsets[-1])}")
        sizes = offsets[1:] - offsets[:-1]
        if bool((sizes < 0).any()):
            at = int((sizes < 0).nonzero()[0, 0])
            raise ValueError(f"{name}.offsets must be non-decreasing, got offsets[{at}] = {int(offsets[at])} > "
                             f"offsets[{at + 1}] = {int(offsets[at + 1])}")
        if k == 0:
            return SamplingMask(token_ids, offsets)
        low, high = torch.aminmax(token_ids)  # (no [K] temporary: K may be N x V)
        if int(low) < 0 or int(high) >= vocab_size:
            bad = (token_ids < 0) | (token_ids >= vocab_size)
            at = int(bad.nonzero()[0, 0])
            row = int(torch.searchsorted(offsets, torch.tensor(at, device=offsets.device), right=True)) - 1
            raise ValueError(f"{name} holds id {int(token_ids[at])} outside [0, {vocab_size}) (the vocabulary) "
                             f"in the set of position {row}")
        repeat = _first_repeat(token_ids, offsets, sizes, vocab_size)
        if repeat is not None:
            raise ValueError(f"{name} repeats id {repeat[1]} in the set of position {repeat[0]}: "
                             f"a kept set holds each id once")
        return SamplingMask(token_ids, offsets)

    def __repr__(self) -> str:
        return (f"SamplingMask(num_positions={self.num_positions}, entries={self.token_ids.numel()}, "
                f"device={self.token_ids.device})")
