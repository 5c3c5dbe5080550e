"""Compiled transformer blocks: each block's own computation through ``torch.compile``, every hook outside it.

:func:`compile_blocks` compiles the forward of every transformer block of a model (the classes a Hugging Face model
names in ``_no_split_modules``: :mod:`ds_odc.training.blocks`, the rule ODC's block fetch follows too). What is
compiled is the block's ``forward``, not its ``__call__``: the module hooks of DeepSpeed (stock ZeRO-3's fetch and
release, ODC's block fetch) and of FSDP2 run around the compiled region, never inside it, so they neither break its
graph nor get traced. Under ODC's ``fetch_unit: "block"`` (and stock ZeRO-3 with the same leaf-module flag) a
block's parameters are ordinary full tensors while its forward runs: the compiled graph is the one an unsharded model
would get.

How it is done: each block's class is replaced by a subclass of the same name whose ``forward`` calls the compiled
original (FSDP2 swaps classes the same way). Every block of a class shares one compiled function, so a 28-layer
model compiles its block once, not 28 times. Activation checkpointing (transformers' ``gradient_checkpointing``)
stays outside the compiled region as well: the recomputation calls the compiled forward again.

Sequence length is dynamic (``dynamic=True``): a packed row of a new length reuses the graphs compiled for the first
one. Python ints passed to the block (``max_length_q``) are dynamic as well. Three things would otherwise compile a
block again mid-run, each for a new class of rows rather than a new length: inductor's mix-order reduction guards
on the length (it runs non-strict here, see :func:`_mode_or_options`), code after a graph break guards on the
layout of what crossed it (``ds_odc_varlen`` returns one layout), and dynamo ties the number of document
boundaries to any size it happens to equal (the boundaries' length is left unbacked, see :func:`_boundaries_unbacked`).

Packed attention (``ds_odc_varlen``) reads the documents' lengths on the host for its per-document kernels; under
compilation it runs outside the graph (one graph break per attention call), except the pure ``varlen`` kernel with
the boundaries given as tensors (``cu_seq_lens_q`` and ``max_length_q``), which stays in the graph
(see ``ds_odc.training.attention``).

Where compiling is impossible (a model without block classes, a backend that fails, such as inductor on a CPU
without a C++ compiler) a warning says so once and the blocks run eagerly: the same numbers, without the speed.
A block called with a KV cache (generation) runs eagerly too: compiled blocks are for training and scoring
forwards, whose shapes vary only in length.

:func:`compile_blocks_on_engine_compile` gives a DeepSpeed engine a ``compile()`` that compiles the blocks: what
Accelerate calls for ``TrainingArguments(torch_compile=True)`` then compiles blocks instead of the whole module (where
every ZeRO-3 hook would break the graph).

:func:`compile_counts` reads dynamo's process-wide counters (graphs, compiled frames, graph breaks), so a run can
report how many graphs it compiled and whether anything compiled again after warm-up.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any

import torch

from ds_odc.training.blocks import transformer_blocks

__all__ = ["compile_blocks", "compile_counts"]

_ATTR = "ds_odc_compiled_blocks"  # the CompiledBlocks of a model, set on the model


@dataclass(frozen=True)
class CompileOptions:
    """How blocks are compiled: ``torch.compile``'s ``backend`` (``"inductor"``; ``"aot_eager"`` traces and runs the
    same aten graph without generating code, for tests), ``mode`` (``None``, ``"max-autotune-no-cudagraphs"``, ...)
    and ``dynamic`` (``True``: sizes are symbolic from the first compile, so varying lengths never recompile)."""

    backend: Any = "inductor"  # a name, or a callable backend
    mode: str | None = None
    dynamic: bool | None = True
    fullgraph: bool = False

    def describe(self) -> str:
        backend = self.backend if isinstance(self.backend, str) else getattr(self.backend, "__name__", "custom")
        return f"torch.compile(backend={backend!r}, dynamic={self.dynamic}" + \
            (f", mode={self.mode!r}" if self.mode else "") + ")"


@dataclass(frozen=True)
class CompileCounts:
    """dynamo's process-wide counters: ``frames`` compiled (a Python frame compiled again for new guards counts
    again), ``graphs`` (FX graphs handed to the backend), ``graph_breaks``."""

    frames: int = 0
    graphs: int = 0
    graph_breaks: int = 0

    def __sub__(self, other: CompileCounts) -> CompileCounts:
        return CompileCounts(self.frames - other.frames, self.graphs - other.graphs,
                             self.graph_breaks - other.graph_breaks)

    def as_dict(self) -> dict[str, int]:
        return {"frames": self.frames, "graphs": self.graphs, "graph_breaks": self.graph_breaks}


def compile_counts() -> CompileCounts:
    """dynamo's counters now (zero when nothing was compiled). Read from ``torch._dynamo.utils.counters``, the
    counters dynamo's own troubleshooting reports print; no public API gives them."""
    try:
        from torch._dynamo.utils import counters
    except ImportError:  # pragma: no cover - torch without dynamo
        return CompileCounts()
    return CompileCounts(frames=int(counters["frames"]["ok"]), graphs=int(counters["stats"]["unique_graphs"]),
                         graph_breaks=int(sum(counters["graph_break"].values())))


@dataclass
class CompiledBlocks:
    """The compiled blocks of one model. ``eager_reason``: why they run eagerly (``None`` while compiled)."""

    options: CompileOptions
    blocks: list[torch.nn.Module] = field(default_factory=list)
    eager_reason: str | None = None

    @property
    def compiled(self) -> bool:
        return bool(self.blocks) and self.eager_reason is None

    def run_eager(self, reason: str) -> None:
        """From now on every block runs its original forward; says why, once."""
        if self.eager_reason is None:
            self.eager_reason = reason
            warnings.warn(f"ds_odc: transformer blocks run eagerly (not compiled): {reason}", stacklevel=3)

    def describe(self) -> str:
        if not self.blocks:
            return f"not compiled: {self.eager_reason}"
        kinds = sorted({type(b).__name__ for b in self.blocks})
        state = self.options.describe() if self.eager_reason is None else f"eager ({self.eager_reason})"
        return f"{len(self.blocks)} x {kinds}: {state}"


def _is_compile_failure(err: BaseException) -> bool:
    """An error raised while compiling (dynamo's or its backend's), rather than by running compiled code: dynamo's
    own exception types, and any error dynamo raised while tracing the model (it notes the user frame it was in, as
    for the assertion it raises on Liger's patched layers). Falling back to eager is safe for both: an error of the
    model's own code is raised again by the eager run."""
    try:
        from torch._dynamo.exc import BackendCompilerFailed, InternalTorchDynamoError
    except ImportError:  # pragma: no cover
        return False
    return isinstance(err, (BackendCompilerFailed, InternalTorchDynamoError)) or \
        hasattr(err, "innermost_user_frame_summary")


def _failure_reason(err: BaseException) -> str:
    cause = getattr(err, "inner_exception", None) or err  # the backend's own error, where dynamo wraps it
    lines = [line for line in str(cause).strip().splitlines() if line.strip()]
    reason = f"{type(cause).__name__}: {lines[0] if lines and not lines[0].startswith('from user code') else ''}"
    frame = getattr(err, "innermost_user_frame_summary", None)
    if frame is not None:
        reason += f" while tracing {frame.filename}:{frame.lineno} ({(frame.line or '').strip()})"
    return reason[:500]


class _BlockForward:
    """The forward of one block class: compiled, or the original after a compiler failure (for every block of the
    model, said once). A failure at any call falls back: the block's forward is functional (no cache under
    training), so running it again eagerly gives the result the compiled call would have."""

    def __init__(self, original, state: CompiledBlocks):
        self.original, self.state = original, state
        opts = state.options
        self.compiled = torch.compile(original, backend=opts.backend, dynamic=opts.dynamic, fullgraph=opts.fullgraph,
                                      **_mode_or_options(opts))
        from torch._dynamo import decorators
        self.mark_unbacked = getattr(decorators, "mark_unbacked", None)  # not exported by torch._dynamo (2.11-2.13)

    def __call__(self, block, *args, **kwargs):
        if self.state.eager_reason is not None or any(kwargs.get(k) is not None for k in _CACHE_ARGUMENTS):
            return self.original(block, *args, **kwargs)
        for key in _LOSS_ONLY:  # see _LOSS_ONLY
            kwargs.pop(key, None)
        _boundaries_unbacked(kwargs, self.mark_unbacked)
        try:
            return self.compiled(block, *args, **kwargs)
        except Exception as err:  # noqa: BLE001 - only compiler failures are caught; the rest is raised again
            if not _is_compile_failure(err):
                raise
            self.state.run_eager(f"{self.state.options.describe()} failed: {_failure_reason(err)}")
            return self.original(block, *args, **kwargs)


_CACHE_ARGUMENTS = ("past_key_values", "past_key_value", "cache", "layer_past")  # transformers' names, by version
# Loss arguments that a causal LM's forward hands on to every layer with the rest of its keywords (Liger's does): a
# block never reads them, and a float (the global-mean divisor, new at every minibatch) would be a constant of the
# compiled graph, compiled again for every value.
_LOSS_ONLY = ("num_items_in_batch",)


def _mode_or_options(opts: CompileOptions) -> dict[str, Any]:
    """``torch.compile``'s ``mode``, or under inductor the same mode's settings plus one: mix-order reduction (the
    fused reductions of RMSNorm's backward) non-strict, where this torch has the switch. Strict, its size checks
    guard on the sequence length (at width 1536: under 3414 tokens, 3414-4095, 4096 and more), and a block met
    with a length of another class compiles again, mid-run; non-strict skips only those size heuristics."""
    if opts.backend != "inductor":
        return {"mode": opts.mode}
    import torch._inductor
    import torch._inductor.config as inductor_config
    if not hasattr(inductor_config.triton, "mix_order_reduction_non_strict_mode"):
        return {"mode": opts.mode}
    options = dict(torch._inductor.list_mode_options(opts.mode or "default", opts.dynamic))
    options["triton.mix_order_reduction_non_strict_mode"] = True
    return {"options": options}


def _boundaries_unbacked(kwargs: dict, mark) -> None:
    """The documents' boundaries (``cu_seq_lens_q``/``_k``: one more entry than the row has documents) with a length
    that no guard can tie to another size. dynamo gives equal sizes one symbol ("duck sizing"): a row of one document
    has 2 boundaries, as many as a Qwen2 1.5B layer has key heads, and every row of more documents would compile the
    attention call's frame again."""
    for key in ("cu_seq_lens_q", "cu_seq_lens_k"):
        found = kwargs.get(key)
        if mark is not None and isinstance(found, torch.Tensor) and found.dim() == 1:
            mark(found, 0)


def _compiled_class(cls: type, forward: _BlockForward) -> type:
    """A subclass of ``cls`` with the same name whose ``forward`` is ``forward``. transformers' checkpointing layer
    wraps a subclass's ``forward`` again and checkpoints only the outermost wrapper, so checkpointing stays around
    the compiled call."""

    def compiled_forward(self, *args, **kwargs):
        return forward(self, *args, **kwargs)

    compiled_forward.__doc__ = getattr(cls.forward, "__doc__", None)
    return type(cls.__name__, (cls,), {"forward": compiled_forward, "__module__": cls.__module__,
                                       "__qualname__": cls.__qualname__, "ds_odc_compiled_from": cls})


def compiled_blocks_of(model: torch.nn.Module) -> CompiledBlocks | None:
    """The :class:`CompiledBlocks` :func:`compile_blocks` recorded on ``model`` (``None`` if never called)."""
    return model.__dict__.get(_ATTR)


def compile_blocks(model: torch.nn.Module, options: CompileOptions | None = None) -> CompiledBlocks:
    """Compile the forward of every transformer block of ``model`` in place (see the module docstring); returns what
    was compiled. Calling it again on the same model returns the first result. Call it before or after
    ``deepspeed.initialize`` / ``fully_shard``; the model's parameters may be partitioned."""
    found = compiled_blocks_of(model)
    if found is not None:
        return found
    options = options or CompileOptions()
    state = CompiledBlocks(options)
    model.__dict__[_ATTR] = state
    blocks = transformer_blocks(model)
    if not blocks:
        state.run_eager(f"{type(model).__name__} names no transformer block classes (_no_split_modules), so there "
                        "is no block to compile")
        return state
    subclasses: dict[type, type] = {}  # one compiled forward per block class of this model
    for block in blocks:
        cls = type(block)
        if getattr(cls, "ds_odc_compiled_from", None) is not None:
            state.blocks.append(block)  # compiled through another model sharing this block
            continue
        if cls not in subclasses:
            subclasses[cls] = _compiled_class(cls, _BlockForward(cls.forward, state))
        block.__class__ = subclasses[cls]
        state.blocks.append(block)
    return state


def compile_blocks_on_engine_compile(engine) -> None:
    """Make ``engine.compile(backend, compile_kwargs)`` (a DeepSpeed engine's; Accelerate calls it when the
    ``TrainingArguments`` ask for ``torch_compile``) compile the blocks of ``engine.module`` with that backend and
    mode instead of the whole module. ``dynamic`` stays ``True`` unless the caller sets it."""
    def compile(backend="inductor", compile_kwargs=None, schedule=None, compiled_autograd_enabled=False):
        kwargs = dict(compile_kwargs or {})
        dynamic = kwargs.get("dynamic")
        options = CompileOptions(backend=backend or "inductor", mode=kwargs.get("mode"),
                                 dynamic=True if dynamic is None else dynamic,
                                 fullgraph=bool(kwargs.get("fullgraph", False)))
        return compile_blocks(engine.module, options)

    engine.compile = compile


def eager_forward(block: torch.nn.Module, *args: Any, **kwargs: Any):
    """``block``'s original (uncompiled) forward, for comparisons."""
    cls = getattr(type(block), "ds_odc_compiled_from", type(block))
    return cls.forward(block, *args, **kwargs)
