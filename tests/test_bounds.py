"""grpo_kernels.bounds: each option declared once, and every entry point holding to the declaration.

Properties, not examples: for every declared loss option (``GRPOOptions``' fields) bad values are
generated from its own declaration (just outside its range, NaN / inf where it must be finite, the
wrong type, an unknown choice, None where it is not Optional), good values from inside it (the range
under a ``loss_mode`` included: cispo's ``eps_low = 1``, DPPO's thresholds above 1). Each value goes
through every entry point it has: the function (``grpo_loss``, its verl spelling where verl names the
option), the module, ``GRPOConfig`` (under the config field that sets it), the ``python -m grpo train``
flag; every one must give the same verdict, and a refusal must name the option as that entry point's
user spelled it. Tiny shapes, the "torch" backend: a few seconds in all.
"""

from __future__ import annotations

import argparse
import math
import random

import numpy as np
import pytest
import torch

import grpo_kernels as gk
from grpo.config import CONFIG_FIELDS_OF, GRPOConfig
from grpo.flags import add_config_flags, config_from_args
from grpo_kernels.bounds import (FINITE, Bounds, OptionError, OptionTypeError, above, at_least, check_value,
                                 describe_bounds)
from grpo_kernels.options import (DIVERGENCE_CLIP_LOSS_MODES, OPTION_DECLARATIONS, OPTION_FIELDS, TRL_ONLY_OPTIONS,
                                  VERL_ONLY_OPTIONS, VERL_SPELLINGS)

pytestmark = pytest.mark.timeout(300)


# --------------------------------------------------------------------------------------------------
# Bounds and check_value, against their definitions
# --------------------------------------------------------------------------------------------------
def test_bounds_hold_exactly_their_interval():
    """``holds`` is the interval its fields describe, at the ends, beyond them, for ints and floats,
    NaN never, infinities only when not ``finite``."""
    rng = random.Random(0)
    for _ in range(300):
        low = rng.choice([None, -1.0, 0.0, 0.5, 1])
        high = rng.choice([None, 1.0, 2.0, 10])
        if low is not None and high is not None and high < low:
            low, high = high, low
        b = Bounds(low, high, rng.random() < 0.5, rng.random() < 0.5, rng.random() < 0.5)
        for x in [rng.uniform(-3, 12), low, high, -math.inf, math.inf, math.nan, 3, 10**400]:
            if x is None:
                continue
            inside = not (isinstance(x, float) and (math.isnan(x) or (b.finite and math.isinf(x))))
            if inside and b.low is not None:
                inside = x > b.low if b.low_open else x >= b.low
            if inside and b.high is not None:
                inside = x < b.high if b.high_open else x <= b.high
            assert b.holds(x) == inside, (b, x)
    assert at_least(0).describe() == ">= 0, finite" and above(0, finite=False).describe() == "> 0"
    assert Bounds(0, 1, high_open=True).describe() == ">= 0, < 1" and at_least(1).describe(integer=True) == ">= 1"


@pytest.mark.parametrize("kind, value, error", [
    (float, "0.1", OptionTypeError), (float, True, OptionTypeError), (float, torch.tensor(0.1), OptionTypeError),
    (float, None, OptionTypeError), (float, math.nan, OptionError), (float, math.inf, OptionError),
    (int, 2.5, OptionTypeError), (int, np.bool_(True), OptionTypeError), (int, 0, OptionError),
    (bool, "False", OptionTypeError), (bool, 1, OptionTypeError), (bool, None, OptionTypeError),
    (bool, torch.tensor([True]), OptionTypeError), (str, 3, OptionTypeError), (str, "nope", OptionError),
])
def test_check_value_refuses_by_name(kind, value, error):
    choices = ("a", "b") if kind is str else None
    with pytest.raises(error, match="the_name"):
        check_value("the_name", value, kind, bounds=at_least(1) if kind in (int, float) else None, choices=choices)
    assert issubclass(OptionTypeError, TypeError) and issubclass(OptionTypeError, ValueError)


def test_check_value_normalises_numpy_and_tensor_flags():
    assert check_value("x", np.float32(0.5), float) == 0.5 and type(check_value("x", np.int64(3), int)) is int
    assert check_value("x", np.bool_(True), bool) is True and check_value("x", torch.tensor(False), bool) is False
    assert check_value("x", None, float, optional=True) is None
    assert check_value("x", [1, 2.5], list[float], bounds=FINITE) == [1.0, 2.5]


def test_an_error_is_respelled_word_by_word():
    e = OptionError("delta must be > 1 + eps_high = 1.28, got 1.1 (dro_beta unrelated)", "delta", "eps_high")
    verl = e.respelled({"delta": "clip_ratio_c", "eps_high": "clip_ratio_high", "beta": "kl_loss_coef"})
    assert str(verl) == "clip_ratio_c must be > 1 + clip_ratio_high = 1.28, got 1.1 (dro_beta unrelated)"
    assert verl.names == ("clip_ratio_c", "clip_ratio_high") and type(verl) is OptionError
    config = e.respelled({}, first="GRPOConfig.delta")
    assert str(config).startswith("GRPOConfig.delta must be > 1 + eps_high")
    assert str(config.respelled({"GRPOConfig.delta": "--delta", "eps_high": "--eps-high"})).startswith(
        "--delta must be > 1 + --eps-high")


def test_mode_ranges_are_declared_once_and_described():
    eps_low = OPTION_FIELDS["eps_low"]
    assert eps_low.metadata["bounds_under"]["cispo"].holds(1.0) and not eps_low.metadata["bounds"].holds(1.0)
    for mode in DIVERGENCE_CLIP_LOSS_MODES:
        assert eps_low.metadata["bounds_under"][mode].holds(1.5)
    assert describe_bounds(eps_low) == ">= 0, < 1; cispo: >= 0, <= 1; dppo_tv, dppo_kl: >= 0, finite"
    # the config's fields are the loss's declarations, the same objects
    config = {f.name: f for f in __import__("dataclasses").fields(GRPOConfig)}
    assert config["eps_low"].metadata["bounds_under"] == eps_low.metadata["bounds_under"]
    for option, fields in CONFIG_FIELDS_OF.items():
        for name in fields:
            assert config[name].metadata["bounds"] is OPTION_FIELDS[option].metadata["bounds"], name
            assert config[name].metadata["choices"] is OPTION_FIELDS[option].metadata["choices"], name


# --------------------------------------------------------------------------------------------------
# every option x bad / good value x entry point
# --------------------------------------------------------------------------------------------------
def modes_of(name: str) -> list:
    """The loss_mode contexts an option is tried under: its own modes' ranges, verl's options under verl."""
    if name == "eps_low":
        return [None, "cispo", "dppo_tv"]
    if name in VERL_ONLY_OPTIONS and name != "dro_beta":
        return ["vanilla"]
    if name == "dro_beta":
        return ["dro"]
    if name == "delta":
        return [None, "vanilla"]
    return [None]


def bad_values(name: str, mode) -> list:
    d = OPTION_DECLARATIONS[name]
    bounds = d.bounds_under.get(mode, d.bounds) if mode is not None else d.bounds
    out = []
    if d.kind is bool:
        out += ["False", 1, np.float64(1.0)]
    elif d.kind is str:
        out += ["nope", 3]
    else:
        out += ["0.5", True, torch.tensor(0.5)]
        if d.kind is int:
            out.append(2.5)
        if bounds is not None:
            if bounds.low is not None:
                out.append(bounds.low if bounds.low_open else bounds.low - 1)
            if bounds.high is not None:
                out.append(bounds.high if bounds.high_open else bounds.high + 0.5)
            if bounds.finite and d.kind is float:
                out += [math.nan, math.inf, -math.inf]
    if not d.optional:
        out.append(None)
    return out


def good_values(name: str, mode) -> list:
    d = OPTION_DECLARATIONS[name]
    bounds = d.bounds_under.get(mode, d.bounds) if mode is not None else d.bounds
    if d.kind is bool:
        return [True, np.bool_(False)]
    if d.kind is str:
        return [c for c in d.choices if name != "loss_mode"][:3]  # (loss_mode's own sweep: test_objective)
    low = 0 if bounds is None or bounds.low is None else bounds.low
    values = [low + (1 if d.kind is int or bounds.low_open else 0)] if bounds is not None else [0.5]
    if bounds is not None and bounds.high is not None and not bounds.high_open:
        values.append(bounds.high)
    if name == "delta" and mode is None:
        values = [1.5]  # (> 1 + eps_high under loss_type)
    if name == "eps_low" and mode in DIVERGENCE_CLIP_LOSS_MODES:
        values.append(1.5)
    return values


g = torch.Generator().manual_seed(0)
B, T, V = 2, 3, 7
LOGITS, IDS, ADV = torch.randn(B, T, V, generator=g), torch.randint(0, V, (B, T), generator=g), torch.randn(B, generator=g)
LOGPS = {k: torch.log_softmax(LOGITS, -1).gather(-1, IDS[..., None])[..., 0] + 0.1 * torch.randn(B, T, generator=g)
         for k in ("old_logps", "ref_logps", "rollout_logps")}


def context(name: str, mode) -> dict:
    """The other keywords a call with ``name`` needs to run (its vocabulary, the tensors it reads)."""
    kw = {} if mode is None else {"loss_mode": mode, **({"dro_beta": 0.1} if mode == "dro" and name != "dro_beta" else {})}
    if name in TRL_ONLY_OPTIONS or name.startswith(("vespo", "sapo")):
        kw["loss_type"] = "vespo" if name.startswith("vespo") else "sapo" if name.startswith("sapo") else "grpo"
    if name.startswith("rollout_correction") and name != "rollout_correction":
        kw["rollout_correction"] = "token_truncate"
    return kw


def config_context(name: str, mode) -> dict:
    kw = context(name, mode)
    if "rollout_correction" in kw:
        kw.pop("rollout_correction")
        kw["vllm_importance_sampling_mode"] = "token_truncate"
    if name in ("rollout_correction_min", "rollout_correction_max"):
        kw["vllm_importance_sampling_clip_max" if name.endswith("min") else "vllm_importance_sampling_clip_min"] = None
    return kw


def call_function(name: str, value, mode, spelling: str = None):
    kw = {**context(name, mode), (spelling or name): value}
    if name.startswith("rollout_correction") and "rollout_correction" not in kw:
        kw["rollout_correction"] = "token_truncate"
    inputs = dict(LOGPS)
    if mode is not None:
        inputs.pop("rollout_logps") if kw.get("rollout_correction") is None else None
        inputs.update(num_items_in_batch=5, global_batch_size=2)
    return gk.grpo_loss(LOGITS, IDS, ADV, backend="torch", **inputs, **kw)


def parse_flags(*flags: str):
    parser = argparse.ArgumentParser(prog="train")
    add_config_flags(parser, GRPOConfig)
    return config_from_args(parser.parse_args(list(flags)), GRPOConfig, parser)


def text_of(value, kind):
    """A value as a command line would spell it, or None when it has no spelling there (a flag's text is
    a str: a str given for a number is a Python-only mistake)."""
    if isinstance(value, (bool, np.bool_, torch.Tensor)) or value is None or (isinstance(value, str) and kind is not str):
        return None
    return str(value)


def verdicts(name: str, value, mode, capsys) -> dict:
    """entry point -> the error's text (refused) or None (accepted)."""
    out = {}

    def attempt(where, fn, spelled):
        try:
            fn()
            out[where] = None
        except (TypeError, ValueError) as e:
            assert spelled in str(e), f"{where}: {e!r} does not name {spelled!r}"
            assert not isinstance(e, (AttributeError, KeyError, IndexError, RuntimeError)), repr(e)
            out[where] = str(e)
        except SystemExit as e:
            err = capsys.readouterr().err
            assert e.code == 2, err
            line = [x for x in err.splitlines() if "error:" in x][-1]
            assert spelled in line, f"{where}: {line!r} does not name {spelled!r}"
            out[where] = line

    attempt("function", lambda: call_function(name, value, mode), name)
    attempt("module", lambda: gk.GRPOLoss(**context(name, mode), **{name: value}), name)
    for verl, ours in VERL_SPELLINGS.items():
        if ours == name:
            attempt(f"function as {verl}", lambda: call_function(name, value, mode, spelling=verl), verl)
    config_names = CONFIG_FIELDS_OF.get(name, (name,) if name in GRPOConfig.__dataclass_fields__ else ())
    for field in config_names:
        if name == "rollout_correction":
            continue  # (the config's vllm_importance_sampling_mode is not Optional: its own None is a refusal)
        attempt(f"GRPOConfig.{field}", lambda: GRPOConfig(**config_context(name, mode), **{field: value}),
                f"GRPOConfig.{field}")
        text = text_of(value, OPTION_DECLARATIONS[name].kind)
        if text is not None:
            flags = [f"--{k.replace('_', '-')}={v}" for k, v in config_context(name, mode).items()]
            flag = "--" + field.replace("_", "-")
            attempt(flag, lambda: parse_flags(*flags, f"{flag}={text}"), flag)
    return out


OPTION_CASES = [(name, mode) for name in OPTION_DECLARATIONS for mode in modes_of(name)]


@pytest.mark.parametrize("name, mode", OPTION_CASES, ids=[f"{n}-{m}" for n, m in OPTION_CASES])
def test_every_entry_point_refuses_what_the_declaration_refuses(name, mode, capsys):
    for value in bad_values(name, mode):
        seen = verdicts(name, value, mode, capsys)
        accepted = [where for where, error in seen.items() if error is None]
        assert not accepted, f"{name}={value!r} under loss_mode={mode}: accepted by {accepted}"


@pytest.mark.parametrize("name, mode", OPTION_CASES, ids=[f"{n}-{m}" for n, m in OPTION_CASES])
def test_every_entry_point_accepts_what_the_declaration_allows(name, mode, capsys):
    for value in good_values(name, mode):
        seen = verdicts(name, value, mode, capsys)
        refused = {where: error for where, error in seen.items() if error is not None}
        assert not refused, f"{name}={value!r} under loss_mode={mode}: refused by {refused}"


# --------------------------------------------------------------------------------------------------
# the rules that tie options together: one rule, the same verdict and words everywhere
# --------------------------------------------------------------------------------------------------
CROSS_RULES = [  # (keywords, the words every entry point's error must hold)
    (dict(loss_type="dapo", loss_mode="vanilla"), ["loss_type", "loss_mode", "twice"]),
    (dict(loss_type="grpo", eps_high=0.28, delta=1.25), ["delta", "eps_high", "> 1 +"]),
    (dict(loss_mode="dro"), ["dro_beta"]),
    (dict(loss_type="grpo", dro_beta=0.1), ["dro_beta", "loss_mode"]),
    (dict(loss_mode="vanilla", top_entropy_quantile=0.5), ["top_entropy_quantile", "loss_type"]),
    (dict(loss_mode="vanilla", kl_loss_type="full"), ["kl_loss_type", "distributions"]),
]


@pytest.mark.parametrize("kw, words", CROSS_RULES, ids=[str(i) for i in range(len(CROSS_RULES))])
def test_cross_field_rules_hold_at_every_entry_point(kw, words, capsys):
    errors = {}
    for where, fn in (("function", lambda: gk.grpo_loss(LOGITS, IDS, ADV, backend="torch", **LOGPS, **kw)),
                      ("reference", lambda: gk.grpo_loss(LOGITS, IDS, ADV, backend="reference", **LOGPS, **kw)),
                      ("module", lambda: gk.GRPOLoss(**kw)), ("options", lambda: gk.GRPOOptions(**kw)),
                      ("config", lambda: GRPOConfig(**kw))):
        with pytest.raises(ValueError) as e:
            fn()
        errors[where] = str(e.value)
    with pytest.raises(SystemExit):
        parse_flags(*[f"--{k.replace('_', '-')}={v}" for k, v in kw.items()])
    for where, text in errors.items():
        assert all(w in text for w in words), (where, text)
    # the command line: a usage error naming the first option's flag (argparse's own for a value
    # outside the flag's choices, e.g. kl_loss_type='full')
    line = [x for x in capsys.readouterr().err.splitlines() if "error:" in x][-1]
    assert "--" + words[0].replace("_", "-") in line, line


def test_the_loss_is_named_once():
    """loss_type=None is the documented default (dapo); with loss_mode any loss_type, dapo included, is a second name."""
    assert gk.GRPOOptions(loss_type=None).loss_type == "dapo" and gk.GRPOOptions().loss_type == "dapo"
    assert gk.GRPOOptions(loss_mode="vanilla").loss_type is None and GRPOConfig(loss_mode="vanilla").loss_type is None
    out = gk.grpo_loss(LOGITS, IDS, ADV, loss_type=None, backend="torch")
    assert torch.equal(out.loss, gk.grpo_loss(LOGITS, IDS, ADV, loss_type="dapo", backend="torch").loss)
    for loss_type in gk.options.LOSS_TYPES:
        with pytest.raises(ValueError, match="twice"):
            gk.grpo_loss(LOGITS, IDS, ADV, loss_type=loss_type, loss_mode="gpg", backend="torch")


# --------------------------------------------------------------------------------------------------
# the per-call counts: declared ranges too, on every backend, in verl's spelling
# --------------------------------------------------------------------------------------------------
COUNT_BAD = [0, -2, math.nan, math.inf, np.float64(0.0), torch.tensor(0.0), torch.tensor([3.0, 4.0]), "7", True]


@pytest.mark.parametrize("backend", ["torch", "reference"])
def test_counts_are_positive_finite_numbers_by_name(backend):
    verl = dict(loss_mode="vanilla", loss_agg_mode="seq-mean-token-mean")
    for name, spelling, kw in (("num_items_in_batch", "num_items_in_batch", {}), ("num_items_in_batch", "batch_num_tokens", verl),
                               ("global_batch_size", "global_batch_size", verl)):
        for value in COUNT_BAD:
            with pytest.raises((TypeError, ValueError), match=spelling):
                gk.grpo_loss(LOGITS, IDS, ADV, backend=backend, **kw, **{spelling: value})
        out = gk.grpo_loss(LOGITS, IDS, ADV, backend=backend, **kw, **{spelling: 4})
        assert torch.isfinite(out.loss)
    # global_batch_size is verl's (its seq-mean-* reductions): under loss_type it would be silently unread
    with pytest.raises(ValueError, match="global_batch_size.*loss_mode"):
        gk.grpo_loss(LOGITS, IDS, ADV, backend=backend, loss_type="grpo", global_batch_size=2)
