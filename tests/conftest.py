import os
import textwrap

import torch

# Triton kernels run in the interpreter on machines without a GPU (CI): set before triton loads.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the H200 machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


# transformers' finegrained-fp8 kernel package, stood in: its entry points run the block-scaled
# reference (the real kernel is Triton for a GPU).
_STAND_IN = '''
from gemma4opt.ops.fp8_block import fp8_block_linear_reference
from ._ops import add_op_namespace_prefix   # the loader provides the module kernel-builder generates

CALLS = []


def matmul_2d(A, B, Bs, block_size, output_dtype=None, activation_scale=None):
    CALLS.append((tuple(A.shape), tuple(B.shape), tuple(block_size)))
    return fp8_block_linear_reference(A, B, Bs, *block_size).to(output_dtype or A.dtype)


def matmul_batched(*args, **kwargs):
    raise NotImplementedError


def matmul_grouped(*args, **kwargs):
    raise NotImplementedError
'''


@pytest.fixture
def hf_kernel_slot(monkeypatch):
    """The loader sets transformers' kernel slot and an environment variable: both restored after."""
    from transformers.integrations import finegrained_fp8

    monkeypatch.setattr(finegrained_fp8, "_FINEGRAINED_FP8", finegrained_fp8._FINEGRAINED_FP8)
    monkeypatch.setenv("TRANSFORMERS_DISABLE_DEEPGEMM_LINEAR", "0")


@pytest.fixture
def stand_in_kernel(tmp_path, hf_kernel_slot):
    """The path of a finegrained_fp8 package holding the stand-in above (the hf-fp8 systems of
    bench_generate and bench_fp8_quality load it as transformers' kernel)."""
    pkg = tmp_path / "finegrained_fp8"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(textwrap.dedent(_STAND_IN))
    return pkg
