"""Importing this registers every torch.ops.gemma4opt op (reference + fake + CUDA kernels)."""
from gemma4opt.ops import rms_norm  # noqa: F401
