"""Measuring a verifier's device path: the operations one ``verify_block`` dispatches, and its host reads.

At batch 1 a GPU verifier costs what it launches (issue #20: over 54 H200 rows, ms ≈ 0.61 +
0.0087 × operations counted on the CPU, R² = 0.994), and every read of a device value on the host
stalls the launch queue. Both are counted here on any device, the CPU included, with a
``TorchDispatchMode``: every aten operation that reaches the dispatcher is one operation, and an
operation whose result the host must wait for is also one read. On the CPU no copy crosses a bus,
so the Python conversions that would copy to the host on a GPU (``tolist``, ``numpy``, ``item``)
are counted by patching them for the duration of the count; and a verifier is counted on the path
it takes on a GPU. The tests (tests/test_device_path.py) and the benchmarks share this counter.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..base.randomness import Randomness
from ..plugins.verifiers import BlockVerifier
from ..plugins.verifiers import device_path as gpu_path_everywhere

__all__ = [
    "BlockCount",
    "HOST_CONVERSIONS",
    "OperationCount",
    "READ_OPERATIONS",
    "T",
    "capture_cuda_graph",
    "count_block",
    "is_host_copy",
]

T = TypeVar("T")

_aten = torch.ops.aten
READ_OPERATIONS = frozenset(
    {
        _aten._local_scalar_dense.default,  # item(), bool(t), int(t), float(t), indexing with a 0-dim tensor
        _aten.item.default,  # what item() and bool(t) dispatch under inference mode
        _aten.is_nonzero.default,
        _aten.equal.default,  # returns a Python bool
        _aten.allclose.default,
        _aten.nonzero.default,  # output size read from the device
        _aten.nonzero_numpy.default,  # nonzero(as_tuple=True), and the next two: what inference mode dispatches
        _aten.where.default,  # torch.where(mask)
        _aten.argwhere.default,
        _aten.masked_select.default,
        _aten._unique.default,
        _aten._unique2.default,
        _aten.unique_dim.default,
        _aten.unique_consecutive.default,
        _aten.unique_dim_consecutive.default,
        _aten.repeat_interleave.Tensor,  # repeats given as a tensor: output size read from the device
        _aten.repeat_interleave.self_Tensor,
        _aten.bincount.default,  # output size: the largest value
    }
)
"""Operations that wait for a device value on the host, on every device."""

HOST_CONVERSIONS = ("item", "tolist", "numpy", "__array__")
"""Tensor methods that hand a value to Python; patched during a count (on the CPU none dispatches a read)."""


def is_host_copy(func, args, kwargs) -> bool:
    """A copy from a device tensor into host memory (``.cpu()``, ``.to("cpu")``,
    ``cpu_tensor.copy_(device_tensor)``)."""
    if func in (_aten._to_copy.default, _aten.to.dtype_layout):
        source, destination = args[0].device, kwargs.get("device")
    elif func is _aten.to.device:
        source, destination = args[0].device, args[1]
    elif func is _aten.copy_.default:
        source, destination = args[1].device, args[0].device
    else:
        return False
    return destination is not None and torch.device(destination).type == "cpu" and source.type != "cpu"


def _is_mask_indexing(func, args) -> bool:
    """``x[mask]`` and ``x[mask] = v``: a boolean index turns into ``nonzero`` inside the kernel."""
    if func not in (_aten.index.Tensor, _aten.index_put.default, _aten.index_put_.default):
        return False
    return any(index is not None and index.dtype in (torch.bool, torch.uint8) for index in args[1])


class OperationCount(TorchDispatchMode):
    """Counts dispatched aten operations (``ops``, ``by_operation``) and host reads (``reads``, ``read_names``).

    A context manager; nested dispatches inside a counted conversion (``item`` dispatches its own
    read) count as operations but not as a second read.
    """

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0
        self.reads = 0
        self.by_operation: Counter[str] = Counter()
        self.read_names: list[str] = []
        self._conversion_depth = 0
        self._originals: dict[str, object] = {}

    def __enter__(self) -> "OperationCount":
        for name in HOST_CONVERSIONS:
            self._originals[name] = getattr(torch.Tensor, name)
            setattr(torch.Tensor, name, self._counted_conversion(name, self._originals[name]))
        try:
            return super().__enter__()
        except BaseException:
            self._restore_conversions()
            raise

    def __exit__(self, *exc_info) -> None:
        try:
            super().__exit__(*exc_info)
        finally:
            self._restore_conversions()

    def _restore_conversions(self) -> None:
        for name, original in self._originals.items():
            setattr(torch.Tensor, name, original)
        self._originals.clear()

    def _counted_conversion(self, name: str, original):
        def conversion(tensor, *args, **kwargs):
            if self._conversion_depth == 0:
                self._read(f"Tensor.{name}")
            self._conversion_depth += 1
            try:
                return original(tensor, *args, **kwargs)
            finally:
                self._conversion_depth -= 1

        return conversion

    def _read(self, name: str) -> None:
        self.reads += 1
        self.read_names.append(name)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.ops += 1
        self.by_operation[str(func)] += 1
        is_read = func in READ_OPERATIONS or is_host_copy(func, args, kwargs) or _is_mask_indexing(func, args)
        if is_read and self._conversion_depth == 0:
            self._read(str(func))
        return func(*args, **kwargs)


@dataclass(frozen=True)
class BlockCount:
    """What one ``verify_block`` call dispatched."""

    ops: int
    """Aten operations dispatched (each is at least one kernel launch on a GPU)."""
    reads: int
    """Host reads among them, plus Tensor → Python conversions."""
    read_names: tuple[str, ...]
    """What each read was, in order (for messages)."""


def count_block(
    verifier: BlockVerifier,
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    draft_tokens: torch.Tensor,
    randomness: Randomness,
) -> BlockCount:
    """Count one ``verifier.verify_block`` call, under inference mode as the engine makes it, on the path it
    takes on a GPU (within :func:`specdec_cli.verifiers.device_path`, so on the CPU too: there a verifier
    may otherwise read to skip work, where reads are free).

    target_probs ``[K, L+1, V]``, draft_probs ``[K, L, V]``, draft_tokens ``[K, L]``; randomness as
    the verifier takes it (keyed ``Draws`` for the built-ins).
    """
    with torch.inference_mode(), gpu_path_everywhere(), OperationCount() as count:
        verifier.verify_block(target_probs, draft_probs, draft_tokens, randomness)
    return BlockCount(count.ops, count.reads, tuple(count.read_names))


def capture_cuda_graph(
    step: Callable[[], T], device: torch.device | str = "cuda", pool=None
) -> tuple[Callable[[], None], T]:
    """``step`` captured in one CUDA graph on ``device``: ``(replay, output)``, where ``replay()`` reruns every
    kernel of ``step`` with one launch and leaves the new result in ``output`` (the same tensors each time).

    ``step`` reads its inputs from tensors that stay in place (copy new values into them between replays).
    Two runs on a side stream come first, as capture requires (the caching allocator and lazy
    initialisations must not happen inside it). A host read inside ``step`` aborts the capture with a
    ``RuntimeError``: capture is the GPU's own proof that a step has none. ``pool``: a
    ``torch.cuda.graph_pool_handle()`` shared by graphs that never replay at once. Streams and graph are
    made on ``device`` (the current device may be another one).
    """
    with torch.cuda.device(device):
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(2):
                step()
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, stream=torch.cuda.Stream(device)):
            output = step()

    def replay() -> None:
        with torch.cuda.device(device):
            graph.replay()

    return replay, output
