"""tensor_parallel=True over two ranks (gloo, spawned CPU processes), every tiny Gemma-4 variant
(k_eq_v and the MoE's one global KV head are replicated across the ranks), in the "hf" and the
paged mode: greedy tokens with a left-padded row and decode past the sliding window equal
single-process HF eager's on the whole model."""
import json
import os

import pytest
import torch.multiprocessing as mp

import gemma4opt
from tests.models import VARIANTS, tiny
from tests.parallel.tp_worker import run

WORLD = 2


@pytest.mark.parametrize("variant", VARIANTS)
def test_two_ranks_generate_the_single_process_tokens(tmp_path, variant):
    mp.start_processes(run, args=(WORLD, str(tmp_path), variant, str(tmp_path)), nprocs=WORLD, join=True,
                       start_method="spawn")
    check(tmp_path, WORLD)


def check(out_dir, world):
    """Every rank's tokens equal single-process eager's, in every mode, from its own share."""
    results = [json.load(open(os.path.join(out_dir, f"rank{r}.json"))) for r in range(world)]
    for rank, out in enumerate(results):
        for mode, r in out.items():
            assert r["equal"], f"rank {rank}, {mode}: {r['got']} != {r['want']}"
            assert r["tp"].startswith(f"rank {rank} of {world}") and r["complete"], (mode, r["tp"])
            assert r["params"] < r["full_params"]       # a share of the weights, not a copy


def test_refusals():
    model = tiny()
    with pytest.raises(ValueError, match="needs torch.distributed initialized"):
        gemma4opt.optimize(model, gemma4opt.Gemma4OptConfig(tensor_parallel=True))
    assert not hasattr(model, "_gemma4opt")                # refused before anything changed
    with pytest.raises(TypeError, match="tensor_parallel"):
        gemma4opt.Gemma4OptConfig(tensor_parallel=2)


def test_a_model_split_by_transformers_is_refused_with_what_to_do():
    model = tiny()
    model._tp_size = 2          # what from_pretrained(tp_plan="auto") leaves on a split model
    with pytest.raises(ValueError, match="split by transformers' tensor parallel.*tensor_parallel=True"):
        gemma4opt.optimize(model)
    assert not hasattr(model, "_gemma4opt")


def test_unsupported_splits_say_why():
    from gemma4opt.tensor_parallel import unsupported

    cfg = tiny().config.get_text_config()
    assert unsupported(cfg, 2) is None
    assert "4 attention heads do not split over 3 ranks" in unsupported(cfg, 3)
    assert unsupported(cfg, 4) is None          # one query head a rank, KV heads replicated
    moe = tiny("tiny-moe").config.get_text_config()
    assert unsupported(moe, 2) is None
    moe.moe_intermediate_size = 15
    assert "moe_intermediate_size=15 does not split over 2 ranks" in unsupported(moe, 2)
