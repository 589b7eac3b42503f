"""On the GPU machine: an optimized model's device memory (weights, merged and fp8 copies, KV pool,
CUDA graphs) comes back after ``del`` and ``gc.collect()``, as HF's model's does, without
``torch._dynamo.reset()`` (tests/e2e/test_freed_after_del.py checks the references on the CPU)."""
import gc

import pytest
import torch

import gemma4opt
from gemma4opt.presets import build_model
from tests.models import prompt

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("config", [None, gemma4opt.Gemma4OptConfig(quantization="fp8", quantize_lm_head=True)],
                         ids=["one-liner", "fp8"])
def test_an_optimized_models_device_memory_comes_back_after_del(config):
    a = torch.ones(64, 64, device="cuda", dtype=torch.bfloat16)
    a @ a                       # cuBLAS's workspace, kept per stream, made before the count starts
    del a
    gc.collect()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    model = build_model("e2b", layers=2, dtype=torch.bfloat16, device="cuda")
    weights = torch.cuda.memory_allocated() - before
    gemma4opt.optimize(model, config)
    ids = prompt(1, 12).cuda()
    for _ in range(2):          # the second call replays the first one's decode graphs
        with torch.no_grad():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False)
    assert model._gemma4opt.graphed_calls > 0
    del model
    gc.collect()
    left = torch.cuda.memory_allocated() - before
    assert left < 0.01 * weights, f"{left / 2**20:.1f} MiB of a {weights / 2**20:.0f} MiB model still allocated"
