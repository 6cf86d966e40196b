"""``grpo_kernels.SamplingMask``: the kept sets in CSR form, its constructors (nested lists, vLLM-shaped
outputs), ``rows`` and ``check`` (every refusal a TypeError / ValueError naming the argument)."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import List, Optional

import numpy as np
import pytest
import torch

from grpo_kernels import SamplingMask


def _sets_of(mask: SamplingMask) -> List[List[int]]:
    """The sets back as lists, straight from the CSR arrays."""
    ids, off = mask.token_ids.tolist(), mask.offsets.tolist()
    return [ids[off[i]:off[i + 1]] for i in range(len(off) - 1)]


# vLLM's output objects, as plain dataclasses with the same attribute layout: a CompletionOutput carries
# ``.token_ids`` (the sampled ids) and ``.sampling_mask.token_ids`` (one kept-id list per sampled token);
# a RequestOutput carries its completions in ``.outputs`` (n of them with SamplingParams(n=n)).
@dataclass
class FakeSamplingMaskRecord:
    token_ids: List[List[int]]


@dataclass
class FakeCompletionOutput:
    index: int
    token_ids: List[int]
    sampling_mask: Optional[FakeSamplingMaskRecord]
    text: str = ""


@dataclass
class FakeRequestOutput:
    request_id: str
    outputs: List[FakeCompletionOutput] = field(default_factory=list)


def _random_completion(rng: random.Random, length: int, vocab: int, index: int = 0) -> FakeCompletionOutput:
    sets = [rng.sample(range(vocab), rng.randint(1, 5)) for _ in range(length)]
    sampled = [rng.choice(s) for s in sets]
    return FakeCompletionOutput(index, sampled, FakeSamplingMaskRecord(sets))


# ------------------------------------------------------------------------------------ constructors
def test_from_lists_nested_batch_is_row_major_and_padded():
    sets = [[[3, 1], [4]], [[1, 5, 9]]]  # B=2, ragged T (2 and 1)
    mask = SamplingMask.from_lists(sets)
    assert mask.num_positions == 4
    assert mask.token_ids.dtype == torch.int64 and mask.offsets.dtype == torch.int64
    assert _sets_of(mask) == [[3, 1], [4], [1, 5, 9], []]
    assert mask.offsets.tolist() == [0, 2, 3, 6, 6]
    assert mask.sizes().tolist() == [2, 1, 3, 0]


def test_from_lists_flat_positions_tensors_and_empty_sets():
    sets = [torch.tensor([7, 2]), np.array([0]), [], (5,)]
    mask = SamplingMask.from_lists(sets)
    assert _sets_of(mask) == [[7, 2], [0], [], [5]]
    empty = SamplingMask.from_lists([[[], []], [[], []]])  # no ids at all: the deepest lists are the sets
    assert empty.num_positions == 4 and empty.token_ids.numel() == 0


def test_from_lists_refuses_bad_nesting():
    with pytest.raises(ValueError, match="one list of kept ids per position"):
        SamplingMask.from_lists([1, 2, 3])
    with pytest.raises(ValueError, match="mixes"):
        SamplingMask.from_lists([[1, [2]]])
    with pytest.raises(ValueError, match="one depth"):
        SamplingMask.from_lists([[[1]], [2]])
    with pytest.raises(TypeError, match="token ids"):
        SamplingMask.from_lists([[1.5]])
    with pytest.raises(TypeError, match="token ids"):
        SamplingMask.from_lists([[True]])


def test_from_vllm_completion_and_request_outputs():
    rng = random.Random(0)
    a = _random_completion(rng, 3, 50)
    b0, b1 = _random_completion(rng, 5, 50, 0), _random_completion(rng, 2, 50, 1)
    request = FakeRequestOutput("r1", [b0, b1])  # n=2: two sequences, in order
    mask = SamplingMask.from_vllm([a, request])
    assert mask.num_positions == 3 * 5  # three sequences, padded to the longest (5)
    expected = []
    for c in (a, b0, b1):
        expected += c.sampling_mask.token_ids + [[]] * (5 - len(c.token_ids))
    assert _sets_of(mask) == expected
    # every sampled token lies in its own set, at the same row-major position as the targets
    targets = torch.full((3, 5), -100)
    for r, c in enumerate((a, b0, b1)):
        targets[r, :len(c.token_ids)] = torch.tensor(c.token_ids)
    for i, (t, s) in enumerate(zip(targets.reshape(-1).tolist(), _sets_of(mask))):
        assert (t == -100 and s == []) or t in s, i

    padded = SamplingMask.from_vllm([request], T=7)
    assert padded.num_positions == 14
    assert _sets_of(padded)[5:7] == [[], []] and _sets_of(padded)[7:9] == b1.sampling_mask.token_ids


def test_from_vllm_refusals():
    rng = random.Random(1)
    c = _random_completion(rng, 4, 20)
    with pytest.raises(ValueError, match="shorter"):
        SamplingMask.from_vllm([c], T=3)
    with pytest.raises(ValueError, match=r"outputs\[0\]\.sampling_mask is None"):
        SamplingMask.from_vllm([FakeCompletionOutput(0, [1], None)])
    with pytest.raises(ValueError, match=r"outputs\[1\]\.outputs\[0\]\.sampling_mask is None"):
        SamplingMask.from_vllm([c, FakeRequestOutput("x", [FakeCompletionOutput(0, [1], None)])])
    with pytest.raises(ValueError, match="T must be"):
        SamplingMask.from_vllm([c], T=-1)


def test_constructor_needs_tensors():
    with pytest.raises(TypeError, match="SamplingMask.token_ids"):
        SamplingMask([1, 2], torch.tensor([0, 2]))
    with pytest.raises(TypeError, match="SamplingMask.offsets"):
        SamplingMask(torch.tensor([1, 2]), [0, 2])


# ------------------------------------------------------------------------------------------- rows
def test_rows_index_mask_and_slice():
    rng = random.Random(2)
    sets = [rng.sample(range(30), rng.randint(0, 4)) for _ in range(9)]
    mask = SamplingMask.from_lists(sets)
    index = torch.tensor([7, 0, 3, 3, 8])
    assert _sets_of(mask.rows(index)) == [sets[i] for i in index.tolist()]
    pick = torch.tensor([rng.random() < 0.5 for _ in range(9)])
    assert _sets_of(mask.rows(pick)) == [s for s, p in zip(sets, pick.tolist()) if p]
    assert _sets_of(mask.rows(slice(2, 6))) == sets[2:6]
    assert mask.rows(slice(2, 6)).offsets[0].item() == 0
    assert mask.rows(slice(4, 4)).num_positions == 0
    assert mask.rows(torch.zeros(0, dtype=torch.int64)).num_positions == 0


def test_to_and_repr():
    mask = SamplingMask.from_lists([[1, 2], [3]]).to("cpu")
    assert mask.device == torch.device("cpu")
    assert "num_positions=2" in repr(mask)


# ------------------------------------------------------------------------------------------ check
def _mask(ids, offsets, id_dtype=torch.int64, off_dtype=torch.int64):
    return SamplingMask(torch.tensor(ids, dtype=id_dtype), torch.tensor(offsets, dtype=off_dtype))


def test_check_accepts_and_normalises():
    ok = _mask([3, 1, 4], [0, 2, 2, 3], id_dtype=torch.int32, off_dtype=torch.int32).check("sampling_mask", 3, 5)
    assert ok.token_ids.dtype == torch.int64 and ok.offsets.dtype == torch.int64
    assert ok.token_ids.tolist() == [3, 1, 4]
    SamplingMask.from_lists([[], []]).check("sampling_mask", 2, 5)  # all sets empty: fine
    # a set equal to the whole vocabulary
    SamplingMask.from_lists([list(range(5))[::-1]]).check("sampling_mask", 1, 5)


@pytest.mark.parametrize("ids, offsets, n, match", [
    ([0, 5], [0, 1, 2], 2, r"id 5 outside \[0, 5\).*position 1"),
    ([0, -1], [0, 2], 1, r"id -1 outside"),
    ([2, 1, 2], [0, 3], 1, r"repeats id 2 in the set of position 0"),
    ([1, 1], [0, 1, 2], 2, None),  # the same id in two sets is fine
    ([1, 2], [0, 2, 1, 2], 3, "non-decreasing"),
    ([1, 2], [1, 2, 2], 2, "start at 0"),
    ([1, 2], [0, 1, 1], 2, "end at len"),
    ([1, 2], [0, 1, 2], 3, "4 positions|3 positions"),
])
def test_check_refuses_bad_sets(ids, offsets, n, match):
    mask = _mask(ids, offsets)
    if match is None:
        mask.check("sampling_mask", n, 5)
        return
    with pytest.raises(ValueError, match="sampling_mask") as info:
        mask.check("sampling_mask", n, 5)
    import re
    assert re.search(match, str(info.value)), str(info.value)


def test_check_refuses_bad_dtypes_and_shapes():
    with pytest.raises(TypeError, match="sampling_mask.token_ids must be an int32 or int64"):
        SamplingMask(torch.tensor([1.0]), torch.tensor([0, 1])).check("sampling_mask", 1, 5)
    with pytest.raises(TypeError, match="sampling_mask.offsets must be an int32 or int64"):
        SamplingMask(torch.tensor([1]), torch.tensor([0.0, 1.0])).check("sampling_mask", 1, 5)
    with pytest.raises(TypeError, match="sampling_mask.token_ids"):
        SamplingMask(torch.tensor([True]), torch.tensor([0, 1])).check("sampling_mask", 1, 5)
    with pytest.raises(ValueError, match="sampling_mask.token_ids must be 1-D"):
        SamplingMask(torch.tensor([[1]]), torch.tensor([0, 1])).check("sampling_mask", 1, 5)
    with pytest.raises(ValueError, match="call's tensors are on meta"):
        _mask([1], [0, 1]).check("sampling_mask", 1, 5, device=torch.device("meta"))


@pytest.mark.parametrize("size", [3, 40])  # few ids per set (the sorted keys), most of V (the bitmap)
def test_check_finds_repeats_in_small_and_large_sets(size):
    rng = random.Random(size)
    sets = [rng.sample(range(50), size) for _ in range(30)]
    SamplingMask.from_lists(sets).check("sampling_mask", 30, 50)
    sets[17] = sets[17] + [sets[17][1]]
    with pytest.raises(ValueError, match=rf"repeats id {sets[17][1]} in the set of position 17"):
        SamplingMask.from_lists(sets).check("sampling_mask", 30, 50)
