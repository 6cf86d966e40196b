"""grpo.models: loading a model with its tokenizer."""

from __future__ import annotations

import torch

from helpers import save_demo_model

from grpo.models import load_model


def test_load_model_takes_a_loaded_tokenizer_instead_of_a_second_copy(tmp_path):
    """The CLI checks the run with the tokenizer it loaded first; ``load_model(..., tokenizer=)`` returns that
    one (a second copy would hold its bytes for the whole run), with the same weights as a plain load."""
    saved, _ = save_demo_model(tmp_path)
    model, tokenizer = load_model(str(tmp_path))
    assert tokenizer.padding_side == "left" and tokenizer.pad_token is not None
    again, same = load_model(str(tmp_path), tokenizer=tokenizer)
    assert same is tokenizer
    for (name, a), b, c in zip(saved.state_dict().items(), model.state_dict().values(), again.state_dict().values()):
        assert torch.equal(a, b) and torch.equal(b, c), name
