"""Activation memory at long context: checkpointed layer inputs in host memory, each MLP over token chunks.

At 128k tokens two terms of a step's memory dominate, and neither shrinks with LoRA or the fused loss
(``docs/memory.md`` derives both):

- the **checkpointed layer inputs**: with gradient checkpointing every decoder layer keeps its input
  ``[N, H]`` from the forward to its recompute in the backward, ``layers x N x H x b`` bytes (38 GB for
  a Qwen3-8B-shaped model at 131,072 tokens in bf16). :class:`ActivationOffload` moves each of them to
  host memory (pinned, on CUDA) right after it is saved and copies it back ahead of its recompute.
- a layer's **MLP during its recompute and backward**: ``N x intermediate`` activations several times
  over (gate, up, their activation and product, and their gradients). :func:`chunk_mlps` runs each
  decoder layer's MLP over chunks of ``mlp_chunk_tokens`` tokens (:class:`ChunkedMLPFunction`), in the
  forward, in the recompute and with its own backward per chunk, so those activations exist one chunk
  at a time.

Both attach to a transformers model at the module level (``grpo.models.prepare_model`` calls them),
with no model-specific code: the offload wraps the checkpoint function each checkpointed layer calls
(``_gradient_checkpointing_func``, set by transformers' ``activation_checkpointing_enable``) in
``torch.autograd.graph.saved_tensors_hooks``; the chunking replaces the ``forward`` of every module
that is a decoder layer's ``mlp`` child by one that calls the module's own ``forward`` on each chunk
(so peft's LoRA layers inside the MLP, their dropout included, are chunked with it).

A third swap, :func:`fuse_norms` (``fused_norm``), replaces the ``forward`` of every RMSNorm module of a
known class (:data:`RMSNORM_CLASSES`: Llama, Qwen2/3, Mistral, Gemma 1-3 and their kin; Qwen3's per-head
``q_norm`` / ``k_norm`` too) by ``grpo_kernels.rms_norm``, whose backward keeps ``x`` and one fp32 per row
where transformers' elementwise ops keep several fp32 copies of ``x`` (``grpo.plan``).

Gradients: the offload copies bits, so a run with it has bitwise the gradients of the run without it.
The chunking computes the same per-token function; the parameter gradients are sums over chunks
instead of one sum over all tokens, equal to fp32 rounding (accumulated in fp32 for 16-bit weights).
The trainer's LoRA dropout (``grpo.lora.DropoutLinear``) draws the same masks chunked or not: each chunk
runs inside a :class:`RowChunk` (its first row, and the seeds the call's first chunk drew), and the
masks are a hash of (seed, absolute row, feature). (peft's own ``nn.Dropout``, where it is left in
place, draws chunk by chunk from torch's generator: its masks depend on the chunking.)

On a CPU the checkpointed inputs already live in host memory: ``prepare_model`` then attaches no
offload and logs one INFO line (:func:`offload_checkpointed_inputs`); :class:`ActivationOffload` itself
runs on a CPU too (it copies into separate host buffers), which is how the tests check it without a GPU.
"""

from __future__ import annotations

import logging
import threading
import types
import weakref
from contextlib import contextmanager, nullcontext
from typing import Any, Callable, Iterator, Optional, Sequence

import torch

from grpo_kernels.bounds import OptionError, at_least, check_value
from grpo_kernels.norm import NORM_BACKENDS, rms_norm

logger = logging.getLogger(__name__)

# mlp_chunk_tokens' range, declared once: GRPOConfig's field (and so its flag and the plan) declares it
# with this object, and chunk_mlps checks a direct call against it (grpo_kernels.bounds)
MLP_CHUNK_TOKENS = at_least(1)


def check_chunk_tokens(chunk_tokens: Any, name: str = "mlp_chunk_tokens") -> int:
    """``chunk_tokens`` checked against :data:`MLP_CHUNK_TOKENS` (an int, not a bool): returned as an int,
    or ``OptionTypeError`` / ``OptionError`` naming ``name``."""
    return check_value(name, chunk_tokens, int, bounds=MLP_CHUNK_TOKENS, why="tokens per MLP chunk")


def check_offload(activation_offload: bool, gradient_checkpointing: bool) -> None:
    """The one rule that ties ``activation_offload`` to another setting: it needs
    ``gradient_checkpointing`` (without it no layer input is kept for a recompute: nothing to offload).
    ``OptionError`` naming both (each entry point re-spells them: ``GRPOConfig.activation_offload``,
    ``--activation-offload``). The types are the declarations' business (``GRPOConfig``)."""
    if activation_offload and not gradient_checkpointing:
        raise OptionError("activation_offload moves the inputs gradient checkpointing keeps for each layer's recompute "
                          "to host memory: it needs gradient_checkpointing", "activation_offload",
                          "gradient_checkpointing")


# --------------------------------------------------------------------------------------------------
# checkpointed layer inputs in host memory
# --------------------------------------------------------------------------------------------------
class _Group:
    """The tensors one checkpointed call saved (a layer's inputs), and the group saved before it."""

    __slots__ = ("copies", "previous", "__weakref__")

    def __init__(self, previous: Optional["_Group"]) -> None:
        self.copies: list[weakref.ref] = []
        self.previous = weakref.ref(previous) if previous is not None else None


class _HostCopy:
    """One saved tensor while it lives in host memory: what the pack hook returns and autograd keeps."""

    __slots__ = ("host", "device", "on_device", "ready", "group", "owner", "__weakref__")

    def __init__(self, host: torch.Tensor, device: torch.device, group: _Group, owner: "ActivationOffload") -> None:
        self.host = host
        self.device = device
        self.on_device: Optional[torch.Tensor] = None  # the copy back, once issued
        self.ready: Optional[Any] = None  # CUDA: the event that copy is done at
        self.group = group
        self.owner = owner

    def __del__(self) -> None:  # (the graph released it: after its backward, or unused)
        owner = getattr(self, "owner", None)
        if owner is not None:
            owner.host_bytes -= _nbytes(self.host)


def _nbytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


class ActivationOffload:
    """Saved-tensor hooks that keep what a checkpointed call saves (its inputs) in host memory.

    Wrapped around ``torch.utils.checkpoint.checkpoint`` (:meth:`checkpoint`), the pack hook sees only
    the checkpoint's own inputs: the tensors saved inside the checkpointed function go through the
    checkpoint's hooks (the innermost pair wins), which keep nothing. Each input on ``device``
    is copied to a host buffer; the device tensor is released as soon as the copy is done. In the
    backward the recompute of a layer unpacks its inputs: they are copied back (if the prefetch has
    not already), and the inputs of the layer saved before it, the next to be recomputed, are
    prefetched. Inputs not on ``device`` are kept as they are.

    On CUDA the buffers are pinned and both copies run on a side stream, so they overlap the layers'
    compute: the copy out waits only for the tensor to be produced (``wait_stream``), the tensor's
    memory is not reused before the copy has read it (``record_stream``), and the compute stream
    waits for a copy back only where it uses it (an event). Device memory then holds at most two
    layers' inputs in the backward (the one recomputed and the one prefetched) instead of all of them.
    On a CPU the same steps run without streams into ordinary host buffers (the tests' path; the
    trainer attaches no offload on a CPU).

    ``host_bytes`` / ``peak_host_bytes``: host memory held now / at most; ``copies_out`` /
    ``copies_in``: tensors copied each way.
    """

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self._streams: dict[Any, Any] = {}
        self._last: Optional[weakref.ref] = None
        self.host_bytes = 0
        self.peak_host_bytes = 0
        self.copies_out = 0
        self.copies_in = 0

    def __deepcopy__(self, memo: dict) -> "ActivationOffload":
        # One offload per process serves every copy of the model (FSDP2 shards a deep copy, the reference
        # model is one): it holds streams and counters, no state of a model.
        return self

    # ---------------------------------------------------------------- attaching
    def attach(self, model: torch.nn.Module) -> int:
        """Route every checkpointed call of ``model`` (each module's ``_gradient_checkpointing_func``, set
        by ``activation_checkpointing_enable``) through :meth:`checkpoint`; returns how many modules.
        Attaching again replaces the earlier offload. ``ValueError`` when nothing of ``model`` is
        checkpointed (gradient checkpointing off: nothing to offload)."""
        count = 0
        for module in model.modules():
            fn = module.__dict__.get("_gradient_checkpointing_func")
            if fn is None or not getattr(module, "gradient_checkpointing", False):
                continue
            inner = fn.checkpoint_fn if isinstance(fn, _OffloadedCheckpoint) else fn
            module._gradient_checkpointing_func = _OffloadedCheckpoint(self, inner)
            count += 1
        if not count:
            raise ValueError(f"activation_offload: no module of {type(model).__name__} is checkpointed; enable "
                             "gradient checkpointing first (gradient_checkpointing=True)")
        return count

    def checkpoint(self, checkpoint_fn: Callable, function: Callable, *args, **kwargs):
        """``checkpoint_fn(function, *args, **kwargs)`` with the tensors it saves (its inputs) offloaded."""
        previous = self._last() if self._last is not None else None
        group = _Group(previous)
        self._last = weakref.ref(group)
        with torch.autograd.graph.saved_tensors_hooks(lambda t: self._pack(t, group), self._unpack):
            return checkpoint_fn(function, *args, **kwargs)

    # ---------------------------------------------------------------- the hooks
    def _stream(self, device: torch.device):
        if device.type != "cuda":
            return None
        key = device.index if device.index is not None else torch.cuda.current_device()
        if key not in self._streams:
            self._streams[key] = torch.cuda.Stream(device=device)
        return self._streams[key]

    def _pack(self, t: torch.Tensor, group: _Group) -> Any:
        if t.device.type != self.device.type:
            return t  # already in host memory (or elsewhere): kept as it is
        side = self._stream(t.device)
        if side is None:
            host = torch.empty_like(t, device="cpu")
            host.copy_(t)
        else:
            side.wait_stream(torch.cuda.current_stream(t.device))  # t is written on the compute stream
            with torch.cuda.stream(side):
                host = torch.empty_like(t, device="cpu", pin_memory=True)
                host.copy_(t, non_blocking=True)
            t.record_stream(side)  # t's memory is not reused before the copy has read it
        copy = _HostCopy(host, t.device, group, self)
        group.copies.append(weakref.ref(copy))
        self.copies_out += 1
        self.host_bytes += _nbytes(host)
        self.peak_host_bytes = max(self.peak_host_bytes, self.host_bytes)
        return copy

    def _fetch(self, copy: _HostCopy) -> None:
        """Issue the copy back to the device (on the side stream, on CUDA)."""
        side = self._stream(copy.device)
        with torch.cuda.stream(side) if side is not None else nullcontext():
            on_device = torch.empty_like(copy.host, device=copy.device)
            on_device.copy_(copy.host, non_blocking=side is not None)
            copy.ready = side.record_event() if side is not None else None
        copy.on_device = on_device
        self.copies_in += 1

    def _fetch_group(self, group: Optional[_Group]) -> None:
        for ref in group.copies if group is not None else ():
            copy = ref()
            if copy is not None and copy.on_device is None:
                self._fetch(copy)

    def _unpack(self, copy: Any) -> torch.Tensor:
        if not isinstance(copy, _HostCopy):
            return copy
        self._fetch_group(copy.group)  # this layer's inputs (a no-op where prefetched)
        self._fetch_group(copy.group.previous() if copy.group.previous is not None else None)  # the next layer's
        out, copy.on_device = copy.on_device, None  # (a second backward through the graph copies again)
        if copy.ready is not None:
            main = torch.cuda.current_stream(out.device)
            main.wait_event(copy.ready)
            out.record_stream(main)  # allocated on the side stream, used and freed on the compute stream
            copy.ready = None
        return out


class _OffloadedCheckpoint:
    """A module's checkpoint function with its saved inputs offloaded (:meth:`ActivationOffload.checkpoint`)."""

    def __init__(self, offload: ActivationOffload, checkpoint_fn: Callable) -> None:
        self.offload = offload
        self.checkpoint_fn = checkpoint_fn

    def __call__(self, function: Callable, *args, **kwargs):
        return self.offload.checkpoint(self.checkpoint_fn, function, *args, **kwargs)


def offload_checkpointed_inputs(model: torch.nn.Module, device: torch.device) -> Optional[ActivationOffload]:
    """``activation_offload``: attach an :class:`ActivationOffload` to ``model`` (checkpointed already), or on a
    CPU, where the checkpointed inputs already are in host memory, attach nothing and log one INFO line."""
    if device.type == "cpu":
        logger.info("activation_offload: on a CPU the checkpointed layer inputs already live in host memory; "
                    "nothing to offload (no-op)")
        return None
    offload = ActivationOffload(device)
    offload.attach(model)
    return offload


# --------------------------------------------------------------------------------------------------
# each decoder layer's MLP over token chunks
# --------------------------------------------------------------------------------------------------
class RowChunk:
    """The chunk of rows a chunked MLP is computing now: ``start``, its first row's index in the whole
    ``[N, H]`` input, and ``seeds``, the random seeds the MLP's layers drew on its first chunk (by module),
    which every later chunk of the same call reuses. ``grpo.lora``'s adapter dropout reads both, so that
    its masks, a function of (seed, absolute row, column), are the unchunked call's whatever the chunking."""

    __slots__ = ("start", "seeds")

    def __init__(self, start: int, seeds: dict) -> None:
        self.start = start
        self.seeds = seeds


_CHUNK = threading.local()


def current_chunk() -> Optional[RowChunk]:
    """The :class:`RowChunk` being computed in this thread, or None outside a chunked MLP."""
    return getattr(_CHUNK, "value", None)


@contextmanager
def _rows_from(start: int, seeds: dict) -> Iterator[None]:
    previous = current_chunk()
    _CHUNK.value = RowChunk(start, seeds)
    try:
        yield
    finally:
        _CHUNK.value = previous


class ChunkedMLPFunction(torch.autograd.Function):
    """``y = f(x)`` for a token-wise ``f`` (an MLP), computed ``chunk`` rows of ``x`` at a time, forward and backward.

    forward(f, chunk, x [N, H], *params) -> y [N, H']: ``f`` on each chunk of rows under no_grad, into
    one preallocated output; only ``x`` is saved (and the RNG state, so that dropout inside ``f`` draws
    the same masks when the backward recomputes it).

    backward: for each chunk, in the forward's order and from the forward's RNG state and autocast
    state, ``f`` is recomputed with grad on that chunk alone and differentiated at once
    (``torch.autograd.grad`` against the chunk's ``dy``): ``dx`` rows are written into ``dx`` [N, H], the
    parameter gradients (of ``params``, the trainable tensors ``f`` uses) summed over the chunks (in
    fp32 for 16-bit parameters) and returned as the gradients of the ``params`` inputs. Returned, not
    accumulated into ``.grad`` inside the backward: each parameter then gets one gradient from the
    autograd engine, so DDP's and FSDP2's gradient hooks fire once, as for the unchunked module.

    Under non-reentrant gradient checkpointing the layer's recompute runs this forward again (the
    saved ``x`` comes back through the checkpoint's holders; the output is discarded) and then this
    backward: the MLP runs forward three times (forward, recompute, per-chunk recompute) instead of
    twice. Same idea as verl's ``verl/models/transformers/tiled_mlp.py`` (``TiledMLP``), which
    accumulates into ``.grad`` through hooks and restores no RNG or autocast state.
    """

    @staticmethod
    def forward(ctx, f: Callable[[torch.Tensor], torch.Tensor], chunk: int, x: torch.Tensor, *params: torch.Tensor):
        ctx.f, ctx.chunk = f, chunk
        ctx.device_type = x.device.type
        ctx.cpu_rng = torch.get_rng_state()
        ctx.device_rng = torch.cuda.get_rng_state(x.device) if x.is_cuda else None
        ctx.autocast = [(kind, torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind))
                        for kind in {x.device.type, "cpu"} if torch.amp.is_autocast_available(kind)]
        ctx.save_for_backward(x, *params)
        return _in_chunks(f, x, chunk)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x, *params = ctx.saved_tensors
        want_x = ctx.needs_input_grad[2]
        wanted = [i for i, p in enumerate(params) if ctx.needs_input_grad[3 + i]]
        dx = torch.empty_like(x) if want_x else None
        sums: list[Optional[torch.Tensor]] = [None] * len(params)
        devices = [x.device] if ctx.device_rng is not None else []
        with torch.random.fork_rng(devices=devices, device_type=ctx.device_type if devices else "cuda"):
            torch.set_rng_state(ctx.cpu_rng)
            if ctx.device_rng is not None:
                torch.cuda.set_rng_state(ctx.device_rng, x.device)
            seeds: dict = {}  # (drawn again on the first chunk, from the forward's RNG state: the same seeds)
            with _autocast_as(ctx.autocast), torch.enable_grad():
                for start in range(0, x.shape[0], ctx.chunk):
                    xc = x[start:start + ctx.chunk].detach().requires_grad_(want_x)
                    with _rows_from(start, seeds):
                        yc = ctx.f(xc)
                    inputs = ([xc] if want_x else []) + [params[i] for i in wanted]
                    grads = torch.autograd.grad(yc, inputs, dy[start:start + ctx.chunk], allow_unused=True)
                    del yc
                    if want_x:
                        dx[start:start + xc.shape[0]] = grads[0]
                        grads = grads[1:]
                    for i, g in zip(wanted, grads):
                        if g is None:
                            continue  # (a parameter this chunk does not reach)
                        if sums[i] is None:
                            sums[i] = g.float() if g.dtype in (torch.float16, torch.bfloat16) else g
                        else:
                            sums[i].add_(g)
        param_grads = [None if s is None else s.to(p.dtype) for s, p in zip(sums, params)]
        return (None, None, dx, *param_grads)


class _autocast_as:
    """Re-enter the autocast states ``[(device_type, enabled, dtype)]`` a forward ran under."""

    def __init__(self, states: Sequence[tuple[str, bool, torch.dtype]]) -> None:
        self.contexts = [torch.autocast(kind, dtype=dtype, enabled=enabled) for kind, enabled, dtype in states]

    def __enter__(self) -> None:
        for c in self.contexts:
            c.__enter__()

    def __exit__(self, *exc) -> None:
        for c in reversed(self.contexts):
            c.__exit__(*exc)


def chunked(f: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, chunk: int,
            params: Sequence[torch.Tensor]) -> torch.Tensor:
    """``f(x)`` for a token-wise ``f`` over ``[..., H]`` inputs, ``chunk`` tokens at a time (all leading
    dimensions flattened: ``[B, T, H]`` padded rows or a ``[1, L, H]`` packed row alike). ``params``:
    the tensors ``f`` uses that may need gradients. At most one chunk: ``f(x)`` itself. Without
    gradients (no_grad, or nothing requiring them) a plain loop; else :class:`ChunkedMLPFunction`."""
    flat = x.reshape(-1, x.shape[-1])
    if flat.shape[0] <= chunk:
        return f(x)
    trainable = [p for p in params if p.requires_grad]
    if torch.is_grad_enabled() and (x.requires_grad or trainable):
        out = ChunkedMLPFunction.apply(f, chunk, flat, *trainable)
    else:
        out = _in_chunks(f, flat, chunk)
    return out.reshape(*x.shape[:-1], out.shape[-1])


def _in_chunks(f: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, chunk: int) -> torch.Tensor:
    """``f(x)`` for rows ``x`` [N, H], ``chunk`` rows at a time, into one output [N, ...] (no autograd of
    its own: the forward of :class:`ChunkedMLPFunction` and the loop without gradients)."""
    out, seeds = None, {}
    for start in range(0, x.shape[0], chunk):
        with _rows_from(start, seeds):
            y = f(x[start:start + chunk])
        if out is None:
            out = y.new_empty((x.shape[0], *y.shape[1:]))
        out[start:start + y.shape[0]] = y
    return out


def _chunked_forward(self: torch.nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """The ``forward`` :func:`chunk_mlps` gives an MLP: its class's own ``forward`` on each chunk."""
    f = types.MethodType(type(self).forward, self)
    return chunked(f, hidden_states, self.mlp_chunk_tokens, list(self.parameters()))


def mlp_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Every module that is some module's child named ``mlp`` (each decoder layer's MLP in the
    Qwen2/3, Llama, Mistral and Gemma families; found by name, whatever its class), each once."""
    found: dict[int, torch.nn.Module] = {}
    for module in model.modules():
        mlp = module._modules.get("mlp")
        if mlp is not None:
            found.setdefault(id(mlp), mlp)
    return list(found.values())


def chunk_mlps(model: torch.nn.Module, chunk_tokens: int) -> int:
    """Run every decoder layer's MLP of ``model`` over chunks of ``chunk_tokens`` tokens (forward,
    recompute and backward); returns how many MLPs. In place: each MLP's ``forward`` becomes
    :func:`_chunked_forward` (an instance attribute: parameter names, state dicts and peft's adapter
    files are unchanged); calling again sets the new size. The MLP must map each token on its own
    (``[..., H] -> [..., H']``, no mixing along the tokens), as every dense decoder MLP does.
    ``ValueError`` naming ``mlp_chunk_tokens`` for a size outside :data:`MLP_CHUNK_TOKENS` (``TypeError``
    for one not an int) or a model without ``mlp`` modules."""
    chunk_tokens = check_chunk_tokens(chunk_tokens)
    mlps = mlp_modules(model)
    if not mlps:
        raise ValueError(f"mlp_chunk_tokens: {type(model).__name__} has no decoder layer with an `mlp` module to chunk")
    for mlp in mlps:
        mlp.mlp_chunk_tokens = chunk_tokens
        if not (isinstance(mlp.__dict__.get("forward"), types.MethodType) and mlp.forward.__func__ is _chunked_forward):
            mlp.forward = types.MethodType(_chunked_forward, mlp)
    return len(mlps)


# --------------------------------------------------------------------------------------------------
# the decoder's RMSNorms through grpo_kernels.rms_norm
# --------------------------------------------------------------------------------------------------
# transformers' RMSNorm classes whose forward is one of the two that grpo_kernels.rms_norm computes, by class
# name: (gemma-style, the attribute holding eps). Llama-style: ``weight * cast(x * r)``; gemma-style:
# ``cast(x * r * (1 + weight))`` (tests/test_activations.py checks each against its class's own forward).
RMSNORM_CLASSES: dict[str, tuple[bool, str]] = {
    **{name: (False, "variance_epsilon") for name in (
        "LlamaRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "MistralRMSNorm", "MixtralRMSNorm", "Qwen2MoeRMSNorm",
        "Qwen3MoeRMSNorm", "Phi3RMSNorm", "GraniteRMSNorm", "SmolLM3RMSNorm")},
    **{name: (True, "eps") for name in ("GemmaRMSNorm", "Gemma2RMSNorm", "Gemma3RMSNorm", "Qwen3NextRMSNorm")},
}


def _fused_norm_forward(self: torch.nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """The ``forward`` :func:`fuse_norms` gives a known RMSNorm: ``grpo_kernels.rms_norm`` with its weight and eps."""
    gemma, eps_name = RMSNORM_CLASSES[type(self).__name__]
    return rms_norm(hidden_states, self.weight, float(getattr(self, eps_name)), gemma=gemma,
                    backend=self.fused_norm_backend)


def norm_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Every module of ``model`` whose class is in :data:`RMSNORM_CLASSES`."""
    return [m for m in model.modules() if type(m).__name__ in RMSNORM_CLASSES]


def norm_backend(loss_backend: str) -> str:
    """The ``rms_norm`` backend for a run's ``backend`` (the loss's): the same kernels where it names
    them ("auto", "triton", "torch"); the torch path for "reference" (a plain-PyTorch run)."""
    return loss_backend if loss_backend in NORM_BACKENDS else "torch"


def fuse_norms(model: torch.nn.Module, backend: str = "auto") -> int:
    """``fused_norm``: every RMSNorm of a known class (:data:`RMSNORM_CLASSES`) in ``model`` computes through
    ``grpo_kernels.rms_norm`` with ``backend`` (its ``forward`` an instance attribute: parameter names and
    state dicts are unchanged; calling again sets the backend); returns how many. A model with none
    (another norm) is left as it is, with one INFO line: ``fused_norm`` defaults to on, so an unknown
    model is not an error."""
    backend = check_value("backend", backend, str, choices=NORM_BACKENDS)
    norms = norm_modules(model)
    for norm in norms:
        norm.fused_norm_backend = backend
        if not (isinstance(norm.__dict__.get("forward"), types.MethodType)
                and norm.forward.__func__ is _fused_norm_forward):
            norm.forward = types.MethodType(_fused_norm_forward, norm)
    if not norms:
        kinds = sorted({type(m).__name__ for m in model.modules() if "norm" in type(m).__name__.lower()})
        logger.info("fused_norm: %s has no RMSNorm the fused kernel knows (its norms: %s); left as they are",
                    type(model).__name__, ", ".join(kinds) or "none")
    return len(norms)
