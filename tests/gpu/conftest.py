import gc

import pytest
import torch


@pytest.fixture(autouse=True)
def _free_the_gpu(request):
    """After each test, give back what it compiled and allocated: Dynamo's caches keep an
    optimized model (its weights, a one-liner's KV pool sized from free memory, its CUDA graphs)
    alive after the test drops it, and Inductor's CUDA-graph trees keep one memory pool per
    process. Without this, a later test in the same process sized its pool from what was left,
    ran out of memory, or met an earlier test's live tensors in the shared graph pool. Tests on
    a module-scoped model (``pair``) keep it until the module ends."""
    yield
    if torch.cuda.is_available() and "pair" not in request.fixturenames:
        torch._dynamo.reset()
        gc.collect()
        torch.cuda.empty_cache()
