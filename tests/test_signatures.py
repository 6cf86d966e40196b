"""Every public function and module writes its keywords out, type and default, equal to their one declaration.

The GRPO keywords are declared once, as the fields of ``options.GRPOInputs`` / ``options.GRPOOptions`` (plus
verl's spellings, ``options.VERL_SPELLINGS``); the log-prob keywords as ``options.LogitTransform``'s and
``prepare.LogprobKeywords``' fields. Each public signature spells them out (``tools/signatures.py`` writes
the blocks) so that a static analyser sees what ``help()`` sees. Here every signature is held equal to
the declarations (names, defaults, annotation text: the modules use ``from __future__ import
annotations``), none takes ``*args`` / ``**kwargs``, the GRPO keywords are all passed on, and the check
itself is shown to fail when a field is added to a declaration and not to the signatures.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import pathlib
from typing import Any, Callable, Dict, List, Optional, Tuple

import pytest
import torch

import grpo_kernels as gk
from grpo_kernels import functional, modules, reference
from grpo_kernels.bounds import option
from grpo_kernels.options import (NOT_GIVEN, ROW_FIELD_ANNOTATIONS, VERL_SPELLINGS, VERL_WITHOUT_EQUIVALENT,
                                  GRPOInputs, GRPOOptions, LogitTransform)
from grpo_kernels.prepare import FP32_LOGITS_DEFAULT, LogprobKeywords
from tools import signatures

ROOT = pathlib.Path(__file__).resolve().parent.parent
Expected = List[Tuple[str, str, Any]]  # (name, annotation text, default)

# each function's own keyword-only parameters besides the declared ones: (annotation, default)
_BACKEND = ("str", "auto")
_GROUP = ("Optional[Any]", None)
_REDUCE = ("bool", False)
_LINEAR = {"chunk_size": ("Optional[int]", None), "accumulate_in_weight_dtype": ("bool", False),
           "fp32_logits": ("bool", FP32_LOGITS_DEFAULT)}
_BIAS = {"bias": ("Optional[torch.Tensor]", None)}
_PER_CALL = {"backend": ("Union[str, NotGiven]", NOT_GIVEN), "process_group": ("Any", NOT_GIVEN),
             "reduce_hidden_grad": ("Union[bool, NotGiven]", NOT_GIVEN)}
# function -> (positional parameters, which declaration, its own keywords)
PUBLIC: Dict[Callable, Tuple[Tuple[str, ...], str, Dict[str, Tuple[str, Any]]]] = {
    functional.token_logprobs: (("logits", "targets"), "logprob",
                                {"backend": _BACKEND, "process_group": _GROUP, "reduce_hidden_grad": _REDUCE}),
    functional.fused_linear_token_logprobs: (("hidden", "weight", "targets"), "logprob", {
        **_BIAS, **_LINEAR, "backend": _BACKEND, "process_group": _GROUP, "reduce_hidden_grad": _REDUCE}),
    functional.grpo_loss: (("logits", "completion_ids", "advantages", "completion_mask"), "grpo", {
        "backend": _BACKEND, "inplace_backward": ("bool", False), "process_group": _GROUP,
        "reduce_hidden_grad": _REDUCE}),
    functional.fused_linear_grpo_loss: (("hidden", "weight", "completion_ids", "advantages", "completion_mask"), "grpo", {
        **_BIAS, **_LINEAR, "backend": _BACKEND, "process_group": _GROUP, "reduce_hidden_grad": _REDUCE}),
    reference.token_logprobs: (("logits", "targets"), "logprob", {}),
    reference.fused_linear_token_logprobs: (("hidden", "weight", "targets"), "logprob",
                                            {**_BIAS, "fp32_logits": _LINEAR["fp32_logits"]}),
    reference.grpo_loss: (("logits", "completion_ids", "advantages", "completion_mask"), "grpo", {}),
    reference.fused_linear_grpo_loss: (("hidden", "weight", "completion_ids", "advantages", "completion_mask"), "grpo",
                                       {**_BIAS, "fp32_logits": _LINEAR["fp32_logits"]}),
    modules.GRPOLoss.__init__: (("self",), "grpo", {
        "backend": _BACKEND, "inplace_backward": ("bool", False), "process_group": _GROUP,
        "reduce_hidden_grad": _REDUCE}),
    modules.FusedLinearGRPOLoss.__init__: (("self",), "grpo", {
        **_LINEAR, "backend": _BACKEND, "process_group": _GROUP, "reduce_hidden_grad": _REDUCE}),
    modules.GRPOLoss.forward: (("self", "logits", "completion_ids", "advantages", "completion_mask"), "per call", {
        **_PER_CALL, "inplace_backward": ("Union[bool, NotGiven]", NOT_GIVEN)}),
    modules.FusedLinearGRPOLoss.forward: (
        ("self", "hidden", "weight", "completion_ids", "advantages", "completion_mask", "bias"), "per call", {
            **_PER_CALL, "chunk_size": ("Union[int, None, NotGiven]", NOT_GIVEN),
            "accumulate_in_weight_dtype": ("Union[bool, NotGiven]", NOT_GIVEN),
            "fp32_logits": ("Union[bool, NotGiven]", NOT_GIVEN)}),
}


def _field_keywords(cls: type, annotations: Dict[str, str] = {}) -> Expected:  # noqa: B006 (read only)
    return [(f.name, annotations.get(f.name, f.type), f.default) for f in dataclasses.fields(cls)]


def declared(kind: str, inputs: type = GRPOInputs, options: type = GRPOOptions) -> Expected:
    """The keywords a declaration gives, read here from the dataclasses themselves (the verl spellings'
    annotations from tools/signatures.py: they are the fields' own, or NOT_GIVEN)."""
    if kind == "logprob":
        return _field_keywords(LogitTransform, ROW_FIELD_ANNOTATIONS) + _field_keywords(LogprobKeywords)
    ours = _field_keywords(inputs) + _field_keywords(options, ROW_FIELD_ANNOTATIONS)
    verl_names = list(VERL_SPELLINGS) + ["clip_ratio"] + list(VERL_WITHOUT_EQUIVALENT)
    tool = {k.name: k for k in signatures.keywords(signatures.grpo_groups(inputs, options))}
    out = ours + [(name, tool[name].annotation, NOT_GIVEN) for name in verl_names]
    if kind == "per call":  # a module's forward: every keyword may be left to the module (NOT_GIVEN)
        out = [(name, signatures.or_not_given(annotation), NOT_GIVEN) for name, annotation, _ in out]
    return out


def mismatches(fn: Callable, positional: Tuple[str, ...], expected: Expected,
               own: Dict[str, Tuple[str, Any]]) -> List[str]:
    """How ``fn``'s signature differs from its positional parameters, the declared keywords and its own."""
    params = inspect.signature(fn).parameters
    problems = [f"*{p.name}" for p in params.values() if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    head = [name for name, p in params.items() if p.kind is p.POSITIONAL_OR_KEYWORD]
    if tuple(head) != positional:
        problems.append(f"positional {head} != {list(positional)}")
    want = {name: (annotation, default) for name, annotation, default in expected}
    for name, spec in own.items():
        assert name not in want, name  # (the table above names a function's own keywords only)
        want[name] = spec
    keywords = {name: p for name, p in params.items() if p.kind is p.KEYWORD_ONLY}
    problems += [f"missing keyword {name}" for name in want if name not in keywords]
    problems += [f"undeclared keyword {name}" for name in keywords if name not in want]
    for name, (annotation, default) in want.items():
        p = keywords.get(name)
        if p is None:
            continue
        if p.annotation != annotation:
            problems.append(f"{name}: annotation {p.annotation!r} != {annotation!r}")
        same = p.default is default or (type(p.default) is type(default) and p.default == default)
        if not same:
            problems.append(f"{name}: default {p.default!r} != {default!r}")
    return problems


@pytest.mark.parametrize("fn", list(PUBLIC), ids=[f"{f.__module__}.{f.__qualname__}" for f in PUBLIC])
def test_public_signature_is_the_declaration(fn):
    positional, kind, own = PUBLIC[fn]
    assert mismatches(fn, positional, declared(kind), own) == []


def test_the_declarations_are_read_from_the_dataclasses():
    """The expected keywords are every field, with its own default (no stale copy of the lists)."""
    names = [name for name, _, _ in declared("grpo")]
    assert names[:len(GRPOInputs.__dataclass_fields__)] == list(GRPOInputs.__dataclass_fields__)
    assert set(GRPOOptions.__dataclass_fields__) <= set(names) and len(names) == len(set(names))
    top_p = {name: (annotation, default) for name, annotation, default in declared("grpo")}["top_p"]
    assert top_p == ("Union[float, torch.Tensor, None]", None)
    assert [name for name, _, _ in declared("logprob")] == (list(LogitTransform.__dataclass_fields__)
                                                            + list(LogprobKeywords.__dataclass_fields__))


def test_the_check_fails_when_a_declaration_changes():
    """A field added to GRPOOptions (or GRPOInputs, or a default changed) and not written into the
    signatures is reported for every GRPO function: the test above cannot pass by construction."""
    extended = dataclasses.make_dataclass(
        "ExtendedOptions", [("min_p", "Optional[float]", option(None, "min-p sampling"))], bases=(GRPOOptions,),
        frozen=True)
    more_inputs = dataclasses.make_dataclass(
        "MoreInputs", [("token_weights", "Optional[torch.Tensor]", dataclasses.field(default=None))],
        bases=(GRPOInputs,), frozen=True)
    changed = dataclasses.make_dataclass("ChangedOptions", [("beta", "float", option(0.04, "KL"))],
                                         bases=(GRPOOptions,), frozen=True)
    for fn, (positional, kind, own) in PUBLIC.items():
        if kind == "logprob":
            continue
        assert mismatches(fn, positional, declared(kind, GRPOInputs, GRPOOptions), own) == []
        assert mismatches(fn, positional, declared(kind, GRPOInputs, extended), own) == ["missing keyword min_p"]
        assert mismatches(fn, positional, declared(kind, more_inputs, GRPOOptions), own) == [
            "missing keyword token_weights"]
        if kind == "grpo":
            assert mismatches(fn, positional, declared(kind, GRPOInputs, changed), own) == [
                "beta: default 0.0 != 0.04"]


def _grpo_dicts(path: pathlib.Path):
    """(function name, the keys of the dict literal assigned to grpo_kwargs / per_call, whether each value
    is the parameter of its own name)."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.FunctionDef):
            for stmt in ast.walk(node):
                if (isinstance(stmt, ast.Assign) and isinstance(stmt.value, ast.Dict)
                        and any(isinstance(t, ast.Name) and t.id in ("grpo_kwargs", "per_call") for t in stmt.targets)):
                    keys = [k.value for k in stmt.value.keys]
                    yield node.name, keys, all(isinstance(v, ast.Name) and v.id == k
                                               for k, v in zip(keys, stmt.value.values))


@pytest.mark.parametrize("name", ["functional.py", "reference.py", "modules.py"])
def test_every_grpo_keyword_is_passed_on(name):
    """The dict a GRPO function builds from its keywords holds every one of them, each as itself (the
    six of functional.py, reference.py and modules.py: a dropped one would be silently ignored)."""
    grpo = {keyword for keyword, _, _ in declared("grpo")}
    found = list(_grpo_dicts(ROOT / "grpo_kernels" / name))
    assert len(found) == {"functional.py": 2, "reference.py": 2, "modules.py": 4}[name], found
    for function, names, as_themselves in found:
        assert grpo <= set(names), (function, grpo - set(names))
        assert as_themselves and len(names) == len(set(names)), function


def test_the_written_blocks_are_current():
    """``python -m tools.signatures --check``: every block is what the declarations write today."""
    assert signatures.stale() == []


def test_signature_is_what_help_and_a_reader_see():
    """inspect.signature is the function's own (no decorator builds it): ``__wrapped__`` is gone, and
    ``top_p`` is a parameter of grpo_loss in its source text."""
    for fn in (gk.grpo_loss, gk.token_logprobs, gk.fused_linear_grpo_loss, gk.fused_linear_token_logprobs):
        assert not hasattr(fn, "__wrapped__") and "top_p" in inspect.signature(fn).parameters
    source = inspect.getsource(functional.grpo_loss)
    assert "    top_p: Union[float, torch.Tensor, None] = None,\n" in source


def test_verl_spellings_and_not_given():
    """verl's spellings default to NOT_GIVEN, so None given is a value (refused where ours refuses it)."""
    logits, ids, adv = torch.randn(2, 3, 5), torch.zeros(2, 3, dtype=torch.long), torch.ones(2)
    with pytest.raises(TypeError, match="kl_loss_coef"):
        gk.grpo_loss(logits, ids, adv, kl_loss_coef=None, backend="torch")
    with pytest.raises(TypeError, match="use_kl_loss.*beta"):
        gk.grpo_loss(logits, ids, adv, use_kl_loss=False, backend="torch")
    a = gk.grpo_loss(logits, ids, adv, clip_ratio_c=None, loss_mode="vanilla", backend="torch").loss
    b = gk.grpo_loss(logits, ids, adv, delta=None, loss_mode="vanilla", backend="torch").loss
    assert torch.equal(a, b) and repr(NOT_GIVEN) == "NOT_GIVEN"
