"""gemma4opt::rope_cos_sin — a rotary embedding's (cos, sin) for a step's positions, one launch.

HF's Gemma-4 rotary embedding, per layer type (transformers >= 5.25; 5.17 forms the product as
a batched matmul, ``matmul=True``)::

    freqs = position_ids[..., None].float() * inv_freq.float()
    emb = cat((freqs, freqs), -1)
    cos, sin = (emb.cos() * scaling).to(dtype), (emb.sin() * scaling).to(dtype)

The reference runs exactly those ops (the CPU path: HF's bits). On CUDA the Triton kernel
(kernels/rope_cos_sin.py) runs where it gives PyTorch's bits: each element is one fp32 product and
one cos or sin, so comparing the kernel with the reference over every position the model can see
(0 .. max_positions) once proves it for every later call. That check runs on the first call for a
given inv_freq, device, dtype and scaling (eager: prefill comes first); a call being captured
into a CUDA graph before it uses the reference. A difference keeps the reference for that
inv_freq, and ``verdicts()`` (the report) says so.
"""
from __future__ import annotations

import weakref

import torch

_CHUNK = 16384          # positions per comparison chunk (fp32 temporaries of ~CHUNK x head_dim)


@torch.library.custom_op("gemma4opt::rope_cos_sin", mutates_args=())
def rope_cos_sin(position_ids: torch.Tensor, inv_freq: torch.Tensor, scaling: float, dtype: torch.dtype,
                 matmul: bool, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    return rope_cos_sin_reference(position_ids, inv_freq, scaling, dtype, matmul)


def rope_cos_sin_reference(position_ids, inv_freq, scaling, dtype, matmul):
    if matmul:      # transformers 5.17: (inv_freq[None, :, None] @ position_ids[:, None, :]).transpose(1, 2)
        inv = inv_freq[None, :, None].expand(position_ids.shape[0], -1, 1).float()
        freqs = (inv @ position_ids[:, None, :].float()).transpose(1, 2)
    else:
        freqs = position_ids[..., None].float() * inv_freq.float()
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * scaling).to(dtype), (emb.sin() * scaling).to(dtype)


@rope_cos_sin.register_fake
def _(position_ids, inv_freq, scaling, dtype, matmul, max_positions):
    shape = (*position_ids.shape, 2 * inv_freq.shape[-1])
    return (torch.empty(shape, dtype=dtype, device=position_ids.device),
            torch.empty(shape, dtype=dtype, device=position_ids.device))


# (inv_freq's address, its version, device, dtype, scaling, matmul, max_positions, TF32 allowed)
# -> (weak reference to that inv_freq, whether the kernel gives the reference's bits, why not).
_VERDICTS: dict[tuple, tuple[weakref.ref, bool, str]] = {}


def _key(inv_freq, dtype, scaling, matmul, max_positions):
    return (inv_freq.data_ptr(), inv_freq._version, str(inv_freq.device), dtype, float(scaling), matmul,
            max_positions, torch.backends.cuda.matmul.allow_tf32)


def kernel_matches(inv_freq: torch.Tensor, scaling: float, dtype: torch.dtype, matmul: bool, max_positions: int,
                   kernel=None) -> bool:
    """Whether the Triton kernel (or ``kernel``: tests) gives the reference's bits at every
    position in [0, max_positions) for this inv_freq: compared chunk by chunk, on inv_freq's device."""
    from gemma4opt.kernels.rope_cos_sin import rope_cos_sin_triton

    kernel = kernel or rope_cos_sin_triton
    end = max(max_positions, 1)
    for lo in range(0, end, _CHUNK):
        pos = torch.arange(lo, min(lo + _CHUNK, end), device=inv_freq.device)[None]
        want = rope_cos_sin_reference(pos, inv_freq, scaling, dtype, matmul)
        got = kernel(pos, inv_freq, scaling, dtype)
        if not all(torch.equal(g.view(torch.uint8), w.view(torch.uint8)) for g, w in zip(got, want)):
            return False
    return True


def uses_kernel(inv_freq, scaling, dtype, matmul, max_positions) -> bool | None:
    """The verdict for these arguments: True / False once checked, None before (checking it now
    unless a CUDA graph is being captured, which cannot run the comparison)."""
    key = _key(inv_freq, dtype, scaling, matmul, max_positions)
    seen = _VERDICTS.get(key)
    if seen is not None and seen[0]() is inv_freq:
        return seen[1]
    if inv_freq.is_cuda and torch.cuda.is_current_stream_capturing():
        return None
    try:
        ok, why = kernel_matches(inv_freq, scaling, dtype, matmul, max_positions), "its cos/sin differ from PyTorch's"
    except Exception as e:      # a kernel that does not build or run here: PyTorch's ops, said in the report
        ok, why = False, f"it failed ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
    _VERDICTS[key] = (weakref.ref(inv_freq), ok, why)
    return ok


def verdicts(tensors=None) -> list[str]:
    """Lines for the report: the inv_freqs (live ones; of ``tensors`` only, if given: a model's
    buffers) whose kernel failed its check, and why."""
    mine = None if tensors is None else {id(t) for t in tensors}
    return [f"rope_cos_sin: the Triton kernel is not used on {k[2]} ({k[3]}, {k[6]} positions): {why}; "
            "PyTorch's ops run" for k, (ref, ok, why) in _VERDICTS.items()
            if not ok and ref() is not None and (mine is None or id(ref()) in mine)]


@rope_cos_sin.register_kernel("cuda")
def _(position_ids, inv_freq, scaling, dtype, matmul, max_positions):
    if uses_kernel(inv_freq, scaling, dtype, matmul, max_positions):
        from gemma4opt.kernels.rope_cos_sin import rope_cos_sin_triton

        return rope_cos_sin_triton(position_ids, inv_freq, scaling, dtype)
    return rope_cos_sin_reference(position_ids, inv_freq, scaling, dtype, matmul)
