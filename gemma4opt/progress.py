"""One-line progress notes on stderr for the slow first steps of an optimized model.

The first generate of a model compiles its graphs, JIT-compiles FlashInfer's kernels on a fresh
machine (~30 s each) and captures decode CUDA graphs: minutes on a large model, which a user
should see happening. ``GEMMA4OPT_PROGRESS=0`` silences them.
"""
from __future__ import annotations

import contextlib
import os
import sys
import time


def enabled() -> bool:
    return os.environ.get("GEMMA4OPT_PROGRESS", "1") not in ("0", "false", "no", "off")


@contextlib.contextmanager
def timed(what: str):
    """'gemma4opt: <what> ...' when it starts, '... done in N s' when it ends."""
    if not enabled():
        yield
        return
    print(f"gemma4opt: {what} ...", file=sys.stderr, flush=True)
    t = time.perf_counter()
    yield
    print(f"gemma4opt: {what}: done in {time.perf_counter() - t:.1f} s", file=sys.stderr, flush=True)
