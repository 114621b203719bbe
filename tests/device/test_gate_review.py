"""docs/copy-engine.md showed ``gate.open_after(h)`` with one handle; open_after took a list, and a
single handle raised TypeError only after the gate counted as opened, so the stream stayed held
for good (a docs check by a helper; fails before). One handle or a list now; anything else is
refused before the gate changes."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from hostkv_providers import HostRegion, KVLayout
from hostkv_providers.device import CopyArgumentError, CpuCopyEngine, HostStream, KVPlanes

LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=4, page_tokens=2, dtype="uint8")


@pytest.mark.parametrize("form", ["one", "list"])
def test_open_after_takes_one_handle_or_a_list(form: str) -> None:
    planes = KVPlanes.from_arrays(LAYOUT, [np.ones((4, 8), np.uint8)] * 2)
    buf = np.zeros(LAYOUT.page_nbytes, np.uint8)
    page = [[HostRegion(0, memoryview(buf), int(buf.ctypes.data), False)]]
    stream = HostStream()
    with CpuCopyEngine() as eng:
        gate = eng.gate(stream)
        ran = threading.Event()
        stream.enqueue(ran.set)  # held behind the gate
        h = eng.save(planes, [1], page)
        gate.open_after(h if form == "one" else [h])
        assert ran.wait(10)
    stream.close()


def test_a_bad_argument_is_refused_and_the_gate_still_opens() -> None:
    stream = HostStream()
    with CpuCopyEngine() as eng:
        gate = eng.gate(stream)
        with pytest.raises(CopyArgumentError):
            gate.open_after(5)  # type: ignore[arg-type]
        assert not gate.opened
        ran = threading.Event()
        stream.enqueue(ran.set)
        gate.open_now()
        assert ran.wait(10)
    stream.close()
