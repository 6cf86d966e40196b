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


# ---------------------------------------------------------------------------- Policy's methods (issue 46)
def test_policy_methods_run_inside_forward_where_the_wrappers_hooks_are():
    """``policy(Policy.logps, ...)`` (and generate, loss) run the method inside the module's ``forward``, so
    the hooks DDP and FSDP2 rely on fire around every use; the name is the older spelling of the same call;
    anything but one of Policy's methods is refused, naming what it takes."""
    import dataclasses

    import pytest

    from helpers import TINY_UPDATE, random_update_batch, tiny_qwen2
    from grpo.config import GRPOConfig
    from grpo.models import TASKS, Policy

    assert TASKS == (Policy.generate, Policy.logps, Policy.loss)
    cfg = GRPOConfig(**TINY_UPDATE)
    policy, device = Policy(tiny_qwen2()), torch.device("cpu")
    seen = []
    policy.register_forward_pre_hook(lambda module, args, kwargs: seen.append(args[0]), with_kwargs=True)
    batch = dataclasses.replace(random_update_batch(), sampling_mask=None)
    with torch.no_grad():
        logps = policy(Policy.logps, batch, cfg, device)
        assert torch.equal(policy("logps", batch, cfg, device), logps)
    assert logps.shape == batch.completion_ids.shape and torch.isfinite(logps).all()
    out = policy(Policy.loss, batch, cfg, device, num_items_in_batch=batch.loss_mask.sum().float())
    out.loss.backward()
    assert all(p.grad is not None for p in policy.parameters() if p.requires_grad)
    ids = policy(Policy.generate, input_ids=batch.input_ids[:2, :2], attention_mask=torch.ones(2, 2, dtype=torch.long),
                 max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert ids.shape == (2, 5)
    assert seen == [Policy.logps, "logps", Policy.loss, Policy.generate]
    for task in (Policy.forward, "_logps", lambda self: 0, "state_dict"):
        with pytest.raises(TypeError, match=r"task must be one of \['Policy.generate', 'Policy.logps', 'Policy.loss'\]"):
            policy(task, batch, cfg, device)
