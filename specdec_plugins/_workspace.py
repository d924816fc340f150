"""Working arrays the built-in verifiers' CPU paths reuse between blocks."""

from __future__ import annotations

import threading

_PER_THREAD = threading.local()


def per_thread(kind: type, *shape: int):
    """This thread's ``kind(*shape)``, made again when ``shape`` changes: the CPU paths' working arrays over V,
    reused by every solve. Fresh ones of megabytes cost a page fault per 4 KB whenever the allocator has handed
    the memory back to the system (about 5 ms at V = 128k for mentored's), as much as the passes that use them."""
    key = f"{kind.__module__}.{kind.__qualname__}"
    held = getattr(_PER_THREAD, key, None)  # (shape, instance)
    if held is None or held[0] != shape:
        held = (shape, kind(*shape))
        setattr(_PER_THREAD, key, held)
    return held[1]
