"""Python's cyclic garbage collector paused while an optimized model generates on CUDA.

Why: in the paged mode a decode step is one CUDA-graph launch, and HF's deferred stop check lets
the host queue step t+1 while step t runs: the GPU stays busy only while the host's work per step
(~1.2 ms) fits in the device's (~2.4-3.4 ms on the small presets). A process holding an optimized
model tracks ~500k Python objects (FX graphs, Dynamo's guards, the model), and a collection that
reaches the oldest generation walks them all (~200 ms on one CPU core here): one landing inside
generate leaves the GPU idle that long. This is why serving engines freeze or tune the collector
(vLLM gc.freeze()s after capturing its graphs).

Not gc.freeze() (it keeps every object it froze until a gc.unfreeze(), for the whole process):
only gc.disable() for the call, then the state the caller had (a caller who turned the collector
off keeps it off). Garbage made during the call is collected by the first collection after it.
The pause is process-wide while the call runs: other threads allocate without collections too.
"""
from __future__ import annotations

import contextlib
import gc


@contextlib.contextmanager
def gc_paused():
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
