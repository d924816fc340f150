"""The device-path counter itself (specdec_cli.engine.device_path.OperationCount): it sees each kind of host read,
a copy from a device to the host, and no read in pure tensor code.

Every verifier's device path is counted in tests/test_contracts.py (the same operations whatever the data, within
the budget, no read but importance sampling's LP, one graph), beside those checks' negative controls.
"""

from __future__ import annotations

import pytest
import torch

from specdec_cli.engine.device_path import OperationCount, is_host_copy

pytestmark = pytest.mark.usefixtures("one_thread")


_VALUES = torch.tensor([0.25, 0.5, 0.25])
READS = {
    "item": lambda: _VALUES[0].item(),
    "bool": lambda: bool(_VALUES.sum() > 0),
    "tolist": lambda: _VALUES.tolist(),
    "numpy": lambda: _VALUES.numpy(force=True),
    "mask indexing": lambda: _VALUES[_VALUES > 0.3],
    "nonzero": lambda: torch.where(_VALUES > 0.3),
    "0-dim tensor index": lambda: _VALUES[torch.tensor(1)],
    "unique": lambda: _VALUES.unique(),
    "argwhere": lambda: torch.argwhere(_VALUES),
}


@pytest.mark.parametrize("read", READS)
def test_the_counter_sees_each_kind_of_read(read):
    with torch.inference_mode(), OperationCount() as count:
        READS[read]()
    assert count.reads == 1, count.read_names


def test_a_copy_from_a_device_to_the_host_is_a_read():
    """Judged on the arguments alone (a meta tensor stands for a GPU one: this machine may have none)."""
    on_device, on_host, aten = torch.empty(3, device="meta"), torch.empty(3), torch.ops.aten
    assert is_host_copy(aten._to_copy.default, (on_device,), {"device": torch.device("cpu")})
    assert is_host_copy(aten.to.device, (on_device, torch.device("cpu"), torch.float32), {})
    assert is_host_copy(aten.copy_.default, (on_host, on_device), {})
    assert not is_host_copy(aten.copy_.default, (on_device, on_host), {})
    assert not is_host_copy(aten._to_copy.default, (on_host,), {"device": torch.device("cpu")})


def test_the_counter_sees_no_read_in_pure_tensor_code():
    with torch.inference_mode(), OperationCount() as count:
        _VALUES.index_select(0, _VALUES.argmax().view(1)).cumsum(0)
    assert (count.ops, count.reads) == (4, 0), count.by_operation
