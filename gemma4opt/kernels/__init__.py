"""Triton kernels, one file per fused op. Imported lazily: only the CUDA path needs triton."""
