"""What the CUDA paged path (FlashInfer) cannot run is refused up front, naming what is supported.
Only the device type is read, so this runs on a CPU."""
import pytest
import torch

from gemma4opt.paged.install import check_paged_supported
from tests.models import tiny

CUDA = torch.device("cuda")


def test_float32_is_refused_on_cuda_only():
    cfg = tiny().config
    with pytest.raises(ValueError, match="float16 and bfloat16 and this model is torch.float32"):
        check_paged_supported(CUDA, torch.float32, cfg)
    check_paged_supported(torch.device("cpu"), torch.float32, cfg)     # the reference runs it


def test_head_dims_flashinfer_lacks_are_refused():
    from gemma4opt.presets import preset_config

    tiny_cfg = preset_config("tiny")
    dims = sorted({lc.head_dim for lc in tiny_cfg.per_layer_config})
    with pytest.raises(ValueError, match=rf"head_dim {dims[0]} .*\[64, 128, 256, 512\]"):
        check_paged_supported(CUDA, torch.bfloat16, tiny_cfg)
    check_paged_supported(CUDA, torch.bfloat16, preset_config("demo"))   # 64 and 128
    check_paged_supported(CUDA, torch.bfloat16, preset_config("31b", 2))  # 256 and 512
