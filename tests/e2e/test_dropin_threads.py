"""generate and forward from several threads at once on one optimized model give HF's tokens, as
HF's model does: the paged step context, the decode graphs' inputs and Dynamo's compiled entries
are one per model, so its calls take turns (OptimizationState.calls)."""
import copy
import sys
import threading

import pytest
import torch

import gemma4opt
from gemma4opt import Gemma4OptConfig
from tests.models import prompt, tiny

PAGED = Gemma4OptConfig(attention="paged", page_size=4, max_seq_len=96, max_batch_size=4)
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _gen(model, ids):
    with torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False)


@pytest.mark.parametrize("config", [None, PAGED], ids=["default", "paged"])
def test_generate_from_threads_at_once_gives_hfs_tokens(config):
    model = tiny("tiny-ple-shared")
    ref = copy.deepcopy(model)
    gemma4opt.optimize(model, config)
    prompts = [prompt(1, 5 + 2 * i, seed=i) for i in range(3)]
    want = [_gen(ref, p) for p in prompts]
    for p in prompts:                   # compiled for each length first: the threads then race on the steps
        _gen(model, p)
    errors = []

    def worker(i):
        try:
            for _ in range(2):
                if not torch.equal(_gen(model, prompts[i]), want[i]):
                    errors.append(f"thread {i}: tokens differ from HF's")
                with torch.no_grad():
                    if not torch.equal(model(prompts[i]).logits, ref(prompts[i]).logits):
                        errors.append(f"thread {i}: forward differs from HF's")
        except Exception as e:      # noqa: BLE001
            errors.append(f"thread {i}: {type(e).__name__}: {e}")

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)         # switch threads often: interleave the calls' steps
    try:
        threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    assert not errors, errors
