"""One rank of the tensor-parallel tests (spawned by tests/parallel/test_tensor_parallel.py: gloo
on CPU; tests/gpu/test_gpu_tensor_parallel.py: NCCL, one GPU a rank)."""
import copy
import json
import os

import torch
import torch.distributed as dist

import gemma4opt
from gemma4opt import Gemma4OptConfig
from tests.models import WINDOW, prompt, tiny

PAGED = dict(attention="paged", page_size=4, max_seq_len=96, max_batch_size=4)


def _gen(model, ids, mask, new):
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False)


def run(rank: int, world: int, store_dir: str, variant: str, out_dir: str, device: str = "cpu",
        modes: tuple[str, ...] = ("hf", "paged")) -> None:
    store = dist.FileStore(os.path.join(store_dir, "store"), world)
    cuda = device == "cuda"
    if cuda:
        device = f"cuda:{rank}"
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", store=store, rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        model = tiny(variant).to(device)
        ids = prompt(2, WINDOW + 6).to(device)            # decode goes past the sliding window
        mask = torch.ones_like(ids)
        mask[1, :5] = 0                        # row 1 left-padded
        ids[1, :5] = 0
        want = _gen(model, ids, mask, 12)      # single-process HF eager, the whole model
        out = {}
        configs = {"hf": dict(attention="hf"), "paged": PAGED}
        for mode, extra in ((m, configs[m]) for m in modes):
            m = copy.deepcopy(model)
            gemma4opt.optimize(m, Gemma4OptConfig(tensor_parallel=True, **extra))
            got = _gen(m, ids, mask, 12)
            rep = gemma4opt.report(m, print_table=False)
            out[mode] = dict(equal=bool(torch.equal(got, want)), got=got.tolist(), want=want.tolist(),
                             tp=rep.tensor_parallel, complete=all(r.complete for r in rep.rows),
                             params=sum(p.numel() for p in m.parameters()),
                             full_params=sum(p.numel() for p in model.parameters()))
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(out, f)
    finally:
        dist.destroy_process_group()
