"""explain(model, out_dir): every rewrite, readable — depyf's decompiled code plus FX before/after each pass."""
from __future__ import annotations

import os

import torch

from gemma4opt.api import get_state


def explain(model, out_dir: str, input_ids: torch.Tensor | None = None, max_new_tokens: int = 2) -> list[str]:
    """Recompile ``model`` while writing into ``out_dir``:

    - ``graphNN_00_captured.py``, ``graphNN_KK_after_<pattern>.py``: the FX graph before and after each pass;
    - depyf's dump: the decompiled Dynamo bytecode and the compiled graph code for each captured graph.

    Runs a short ``generate`` (prefill + decode graphs) on ``input_ids`` (default: 8 tokens).
    Returns the written file paths.
    """
    import depyf

    state = get_state(model)
    if state.disabled_reason:
        raise ValueError(f"gemma4opt.explain: model is not optimized ({state.disabled_reason})")
    out_dir = os.path.abspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    if input_ids is None:
        vocab = state.text_config.vocab_size
        input_ids = torch.arange(3, 11, device=next(model.parameters()).device).remainder(vocab)[None]
    torch._dynamo.reset()
    for st in state.stats.values():
        st.matched_per_graph.clear()
    state.pass_manager.explain_dir = out_dir
    try:
        with depyf.prepare_debug(out_dir):
            with torch.no_grad():
                model.generate(input_ids, max_new_tokens=max_new_tokens, do_sample=False)
    finally:
        state.pass_manager.explain_dir = None
    return sorted(os.path.join(root, f) for root, _, files in os.walk(out_dir) for f in files)
