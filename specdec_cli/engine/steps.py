"""Model steps through ``torch.compile``: what ``speculation.compile`` (``--compile``) does to the forwards that
extend a static cache (:mod:`.slots`).

Over the static cache a step's shapes depend on its kind, not on the data: a draft step is ``[rows, 1]`` (``[rows,
2]`` when the previous block accepted every draft), target scoring ``[rows, L + 1]``, a token of the target alone
``[rows, 1]``, and every step attends over the cache's whole capacity, rounded up to :data:`CAPACITY_BUCKET`.
dynamo compiles a shape first as it is, and a dimension that then changes (the rows as sequences leave, a short last
block) once more as dynamic, so a generation compiles a few graphs per model (tests/test_compile.py counts them),
reused by every later block and prompt and by every decoder over the same model: dynamo keeps the graphs of the
forward's code, guarded by the model's configuration, so another object of the same architecture reuses them too.
Prefill, whose length is the prompt's, stays eager: one forward per prompt, compute-bound, where compiling each
length would cost more.

On a GPU the compiled steps run in ``reduce-overhead`` mode: each graph is replayed from a CUDA graph, one launch
per step instead of one per kernel. The cache's buffers are static addresses (the graphs write them in place) and a
step's logits are copied out of the graphs' memory before the next step overwrites them. On the CPU inductor
compiles the same graphs without CUDA graphs.

A step that cannot be compiled (a model dynamo cannot trace, a backend missing) runs eager from then on, with one
warning that says why.

What inductor compiles is kept under specdec's cache directory for later runs, one entry per model
(:mod:`.compile_cache`), prepared before the model's first compiled step.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch

from ..base.waits import waiting
from . import compile_cache
from .compile_cache import CompileCacheUse

__all__ = ["CAPACITY_BUCKET", "StepCompiler", "compiling_steps", "step_compiler"]

CAPACITY_BUCKET = 128
"""Compiled steps round a static cache's slots per row up to a multiple of this, so that prompts of different
lengths share graphs (at most a bucket of masked slots more to attend over)."""

_RECOMPILE_LIMIT = 64
"""Graphs dynamo may keep per function: step kinds × row counts × capacities of every model of one class (its
default, 8, would leave a draft and a target of one architecture eager after a few shapes)."""


class StepCompiler:
    """The compiled forward of one model, or its eager forward once compiling it failed."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.on_gpu = next(model.parameters()).device.type == "cuda"
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, _RECOMPILE_LIMIT)
        torch._dynamo.config.accumulated_recompile_limit = max(
            torch._dynamo.config.accumulated_recompile_limit, _RECOMPILE_LIMIT * 4
        )
        self.cache_use = compile_cache.prepare(model)
        """The model's compile cache entry: what it reused, or why it was not trusted."""
        mode = "reduce-overhead" if self.on_gpu else None
        self.forward: Callable[..., Any] | None = torch.compile(model.forward, mode=mode)
        """None once compiling failed: every step then runs eager."""
        self.shapes: set[tuple[int, ...]] = set()
        """The shapes (rows, inputs, capacity) its steps have run: a new one may compile a graph."""

    def compiling(self, shape: tuple[int, ...]) -> AbstractContextManager[None]:
        """A step of a ``shape`` (rows, inputs, the cache's capacity) not run yet compiles its graph, which takes
        seconds to minutes on a CPU: a wait, said while it lasts, after which what was compiled is kept
        (:func:`~.compile_cache.save`). A shape run before passes in silence."""
        if shape in self.shapes:
            return nullcontext()
        self.shapes.add(shape)
        return _compiling_and_keeping(self.cache_use)

    def __call__(self, **kwargs: Any) -> Any:
        """The model's output for ``kwargs``: compiled, or eager where compiling failed (said once)."""
        if self.forward is not None:
            try:
                if self.on_gpu:  # each step is a new generation of the CUDA graphs' memory, not a repeat of one
                    torch.compiler.cudagraph_mark_step_begin()
                output = self.forward(**kwargs)
            except torch._dynamo.exc.TorchDynamoException as error:
                self.forward = None
                warnings.warn(
                    f"--compile: the steps of {type(self.model).__name__} could not be compiled ({_reason(error)}); "
                    "they run eager",
                    RuntimeWarning,
                    stacklevel=2,
                )
            else:
                if self.on_gpu:  # the next replay overwrites the graphs' outputs
                    output.logits = output.logits.clone()
                return output
        return self.model(**kwargs)


@contextmanager
def _compiling_and_keeping(use: CompileCacheUse) -> Iterator[None]:
    """The wait of a compiled step's new shape, then its artifacts written to the model's compile cache entry."""
    with waiting(compiling_steps(use)):
        use.noted = True
        yield
    compile_cache.save()


def compiling_steps(use: CompileCacheUse | None = None) -> str:
    """What a compiled step of a new shape is doing, and what of it a later run keeps (``use``: the model's compile
    cache entry, which says whether an earlier run's kernels are reused, or why they could not be)."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    doing = "compiling the model steps with torch.compile, as each new step shape comes in the first blocks"
    if use is not None and use.reused:
        return f"{doing} (tracing them again; their kernels are reused from {use.entry})"
    if use is not None and use.note and not use.noted:
        return f"{use.note}: {doing} (the compiled kernels are cached in {cache_dir()} for later runs)"
    return f"{doing} (the compiled kernels are cached in {cache_dir()} for later runs)"


def _reason(error: Exception) -> str:
    """One line of why compiling failed: the backend's own error where dynamo wraps one (its message then begins
    with a line that names no cause)."""
    cause = getattr(error, "inner_exception", None) or error
    lines = [line.strip() for line in str(cause).splitlines() if line.strip()]
    return f"{type(cause).__name__}: {lines[0]}" if lines else type(cause).__name__


def step_compiler(model: torch.nn.Module) -> StepCompiler:
    """The one :class:`StepCompiler` of ``model``, shared by every session and decoder over it. It lives on the
    model, so that it goes with it (a table keyed by the model would hold it: the compiler refers to its model)."""
    compiler = getattr(model, "_specdec_steps", None)
    if compiler is None:
        compiler = StepCompiler(model)
        model._specdec_steps = compiler
    return compiler
