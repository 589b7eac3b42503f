"""An optimized model is freed when its last reference goes, as HF's model is: nothing process-wide
(Dynamo's table of backends, a registry, a cache) may keep it, its weights or its KV pool alive. A
user who drops one model to load another gets its memory back with ``del model`` and
``gc.collect()``, without ``torch._dynamo.reset()``."""
import gc
import weakref

import pytest
import torch

import gemma4opt
from gemma4opt import Gemma4OptConfig
from tests.models import greedy, prompt, tiny
from tests.runtime.test_paged_graphs import PAGED, _optimize_with_stand_ins

CONFIGS = {
    "default": None,
    "paged": PAGED,
    "fp8": Gemma4OptConfig(quantization="fp8", quantize_lm_head=True),
    "paged-fp8-kv": Gemma4OptConfig(attention="paged", page_size=4, max_seq_len=96, max_batch_size=4,
                                    kv_cache_dtype="fp8"),
}


def _dropped_after_generate(model) -> tuple[weakref.ref, list[weakref.ref]]:
    """Weak references to the model and to every tensor it holds: its parameters and buffers and the
    storages they are views of (merged q/k/v and gate/up weights, an fp8 copy of the lm_head)."""
    ids = prompt(1, 9)
    greedy(model, ids, new=5)
    greedy(model, ids, new=5)           # a second call: graphs replayed, caches reused
    tensors = [*model.parameters(), *model.buffers()]
    tensors += [t._base for t in tensors if t._base is not None]
    tensors += [v for m in model.modules() for v in vars(m).values() if isinstance(v, torch.Tensor)]
    return weakref.ref(model), [weakref.ref(t) for t in tensors]


def _kept(tensors: list[weakref.ref]) -> list[tuple]:
    return [(tuple(t().shape), t().dtype) for t in tensors if t() is not None]


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_an_optimized_model_is_freed_after_del(name):
    model = tiny("tiny-ple-shared")
    gemma4opt.optimize(model, CONFIGS[name])
    alive, tensors = _dropped_after_generate(model)
    del model
    gc.collect()
    assert alive() is None, "something outside the instance keeps the optimized model alive"
    assert not _kept(tensors)


def test_a_model_with_decode_graphs_is_freed_after_del(monkeypatch):
    # The paged decode steps as CUDA graphs (stood in on the CPU, tests/runtime/test_decode_graphs.py):
    # the graphs' backend and runner must not hold the model either.
    model = tiny("tiny-ple-shared")
    ctx = _optimize_with_stand_ins(monkeypatch, model)
    assert ctx.buckets
    alive, tensors = _dropped_after_generate(model)
    assert alive()._gemma4opt.graphed_calls > 0
    del model, ctx
    gc.collect()
    assert alive() is None, "something outside the instance keeps the optimized model alive"
    assert not _kept(tensors)


def test_a_freed_models_compiled_forward_says_so():
    """Dynamo keeps the backend after the model is gone; a graph compiled through it then raises
    rather than running on a freed model's state."""
    from gemma4opt.compiler.backend import make_backend

    class _State:
        pass

    state = _State()
    backend = make_backend(state, lower=False)
    del state
    gc.collect()
    gm = torch.fx.symbolic_trace(torch.nn.Identity())
    with pytest.raises(RuntimeError, match="has been freed"):
        backend(gm, [torch.zeros(1)])
