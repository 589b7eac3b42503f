"""On the GPU machine: an optimized model's device memory (weights, merged and fp8 copies, KV pool,
CUDA graphs) comes back after ``del`` and ``gc.collect()``, as HF's model's does, without
``torch._dynamo.reset()`` (tests/e2e/test_freed_after_del.py checks the references on the CPU).

What the process makes once and keeps is not the model's: cuBLAS's workspace per stream it has
run on (the picks time GEMMs on side streams, capture runs on its own), FlashInfer's and Triton's
caches. So a first model is made, run and dropped, and the second one's memory must come back to
the level the first left."""
import gc

import pytest
import torch

import gemma4opt
from gemma4opt.presets import build_model
from tests.models import prompt

pytestmark = pytest.mark.gpu


def _settle() -> int:
    gc.collect()
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()
    torch.cuda.empty_cache()
    return torch.cuda.memory_allocated()


def _live_cuda_tensors(limit: int = 8) -> str:
    """What still holds device memory, for the failure message: the largest CUDA tensors the
    collector sees and the types of their referrers."""
    found, graphs = [], 0
    for obj in gc.get_objects():
        try:
            if isinstance(obj, torch.Tensor) and obj.is_cuda:
                found.append(obj)
            graphs += isinstance(obj, torch.cuda.CUDAGraph)
        except Exception:       # objects whose isinstance check raises (lazy proxies)
            continue
    found.sort(key=lambda t: -t.untyped_storage().nbytes())
    lines = []
    for t in found[:limit]:
        holders = sorted({type(r).__name__ for r in gc.get_referrers(t) if r is not found})
        lines.append(f"{tuple(t.shape)} {t.dtype} {t.untyped_storage().nbytes() / 2**20:.1f} MiB, held by {holders}")
    return f"{graphs} CUDA graphs and {len(found)} CUDA tensors alive; largest: " + "; ".join(lines)


def _optimized_run_dropped(config) -> int:
    """Bytes of the model's weights; the model is optimized, generates (its decode graphs captured,
    then replayed) and is dropped."""
    start = torch.cuda.memory_allocated()
    model = build_model("e2b", layers=2, dtype=torch.bfloat16, device="cuda")
    weights = torch.cuda.memory_allocated() - start
    gemma4opt.optimize(model, config)
    ids = prompt(1, 12).cuda()
    for _ in range(2):
        with torch.no_grad():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False)
    assert model._gemma4opt.graphed_calls > 0
    del model
    return weights


@pytest.mark.parametrize("config", [None, gemma4opt.Gemma4OptConfig(quantization="fp8", quantize_lm_head=True)],
                         ids=["one-liner", "fp8"])
def test_an_optimized_models_device_memory_comes_back_after_del(config):
    _settle()
    _optimized_run_dropped(config)          # the process's own caches, made once
    before = _settle()
    weights = _optimized_run_dropped(config)
    left = _settle() - before
    assert left < 0.01 * weights, (f"{left / 2**20:.1f} MiB of a {weights / 2**20:.0f} MiB model still allocated; "
                                   + _live_cuda_tensors())
