"""On a machine with two GPUs (nvidia-h200-x2): tensor_parallel=True over NCCL, one GPU a rank,
every tiny variant in fp32 in the "hf" mode (static cache, decode as CUDA graphs that capture the
NCCL all-reduces): greedy tokens equal single-GPU HF eager's (tests/parallel/tp_worker.py)."""
import pytest
import torch
import torch.multiprocessing as mp

from tests.models import VARIANTS
from tests.parallel.test_tensor_parallel import check
from tests.parallel.tp_worker import run

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("variant", VARIANTS)
def test_two_gpus_generate_the_single_gpu_tokens(tmp_path, variant):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs (the nvidia-h200-x2 machine)")
    mp.start_processes(run, args=(2, str(tmp_path), variant, str(tmp_path), "cuda", ("hf",)), nprocs=2,
                       join=True, start_method="spawn")
    check(tmp_path, 2)
