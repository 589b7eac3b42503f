"""Two branches of a layer on two CUDA streams inside a captured decode graph (patterns/moe_streams.py).

A MoE layer's dense MLP and its router + experts read the same residual and meet again in the
post-feedforward sum; at decode each is a chain of latency-bound kernels that leaves most SMs idle.
The rewritten graph calls these around the experts' branch, in node order::

    token = branch_fork(*branch_inputs)       # side stream waits for the current one, becomes current
    ... the experts' branch (launched on the side stream) ...
    out = branch_back(token, branch_output)   # the current stream again
    ... the dense MLP (current stream) ...
    out = branch_join(token, out)             # the current stream waits for the side stream
    ... their sum ...

Only while a CUDA graph is being captured (the decode graphs): there the fork and join become edges
of the graph, whose replays then run both branches at once. Elsewhere (CPU, prefill, the warm-up
calls, a batch past the largest graph) the three are no-ops and the branches run one after the
other, as before. The results are the same kernels on the same inputs: the same bits.

The branch's inputs are recorded on the side stream: the graph's code frees a tensor after its last
use on the host, and without the record the allocator could hand its memory to the dense branch's
next allocation while the side stream still reads it (during a capture the allocator keeps such
blocks until the capture ends). Tensors the side stream allocates go back to its own pool, reused by
it only after the next fork, which waits for everything the current stream did before.
"""
from __future__ import annotations

import torch

_SIDE: dict[torch.device, torch.cuda.Stream] = {}
FORKS = {"captured": 0}     # forks made inside a capture (tests: the decode graphs did fork)


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    stream = _SIDE.get(device)
    if stream is None:
        stream = _SIDE[device] = torch.cuda.Stream(device=device)
    return stream


def _tensors(values) -> list[torch.Tensor]:
    out = []
    for v in values:
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, (tuple, list)):        # a multi-output op whose item the branch reads
            out += _tensors(v)
    return out


def branch_fork(*inputs):
    """Before the side branch: a token for branch_back / branch_join, None where nothing forks."""
    tensors = _tensors(inputs)
    if not tensors or not tensors[0].is_cuda or not torch.cuda.is_current_stream_capturing():
        return None
    main = torch.cuda.current_stream(tensors[0].device)
    side = _side_stream(tensors[0].device)
    side.wait_stream(main)
    for t in tensors:
        t.record_stream(side)
    torch.cuda.set_stream(side)
    FORKS["captured"] += 1
    return main, side


def branch_back(token, out):
    """After the side branch: the stream current before the fork is current again. Returns ``out``."""
    if token is not None:
        torch.cuda.set_stream(token[0])
    return out


def branch_join(token, out):
    """Before the branches meet: the current stream waits for the side branch. Returns ``out``."""
    if token is not None:
        token[0].wait_stream(token[1])
    return out
