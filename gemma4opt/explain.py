"""explain(model, out_dir): every rewrite, readable — depyf's decompiled code plus FX before/after each pass."""
from __future__ import annotations

import os
import re

import torch

from gemma4opt.api import get_state

# Lists (relative paths, one a line) what the last explain() wrote into its directory: the next
# explain() into that directory deletes exactly those files first, and nothing else.
MANIFEST = ".gemma4opt_explain_files"
# Names explain() and depyf write. One of these with no manifest listing it (an older gemma4opt's
# explain, or a copy) would be mixed with, or appended to, by a new run: explain() refuses then.
_OUTPUT_NAME = re.compile(r"graph\d+_\d+_.*\.py|__compiled_fn_.*|__transformed_code_.*|full_code_for_.*")


def explain(model, out_dir: str, input_ids: torch.Tensor | None = None, max_new_tokens: int = 2) -> list[str]:
    """Recompile ``model`` while writing into ``out_dir``:

    - ``graphNN_00_captured.py``, ``graphNN_KK_after_<pattern>.py``: the FX graph before and after each pass;
    - depyf's dump: the decompiled Dynamo bytecode and the compiled graph code for each captured graph.

    Runs a short ``generate`` (prefill + decode graphs) on ``input_ids`` (default: 8 tokens).
    Returns the paths of the files this call wrote.

    Each call's output is self-contained: graphs are numbered from ``graph00`` in the order this
    call captured them, whatever the model or the process compiled before. ``out_dir`` may be
    reused: explain() records what it wrote in ``out_dir/.gemma4opt_explain_files`` and the next
    call into that directory first deletes those files (and only those), so nothing is appended to
    an earlier run's files. Other files in ``out_dir`` are left alone, except that a file named like
    explain's output (``graphNN_KK_*.py``, depyf's ``__compiled_fn_*``, ``__transformed_code_*``,
    ``full_code_for_*``) that no such record lists raises ``FileExistsError`` before anything runs:
    delete those files or pass an empty directory. Names inside depyf's files (``__compiled_fn_N``)
    carry Dynamo's process-wide counter and need not start at 0.
    """
    import depyf

    state = get_state(model)
    if state.disabled_reason:
        raise ValueError(f"gemma4opt.explain: model is not optimized ({state.disabled_reason})")
    out_dir = os.path.abspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    _clear_previous_output(out_dir)
    before_files, before_dirs = _listing(out_dir)
    if input_ids is None:
        vocab = state.text_config.vocab_size
        input_ids = torch.arange(3, 11, device=next(model.parameters()).device).remainder(vocab)[None]
    torch._dynamo.reset()
    for st in state.stats.values():
        st.forget_graphs()
    state.pass_manager.explain_dir = out_dir
    state.pass_manager.explain_first_graph = state.graphs_compiled
    try:
        with depyf.prepare_debug(out_dir):
            with torch.no_grad():
                model.generate(input_ids, max_new_tokens=max_new_tokens, do_sample=False)
    finally:
        state.pass_manager.explain_dir = None
        files, dirs = _listing(out_dir)
        written, made = sorted(files - before_files), sorted(dirs - before_dirs, key=len, reverse=True)
        with open(os.path.join(out_dir, MANIFEST), "w") as f:      # written even if generate failed
            f.writelines(f"{rel}\n" for rel in written + [d + os.sep for d in made])
    return [os.path.join(out_dir, rel) for rel in written]


def _listing(out_dir: str) -> tuple[set[str], set[str]]:
    """Files (but the manifest) and folders under ``out_dir``, relative to it."""
    files, dirs = set(), set()
    for root, subdirs, names in os.walk(out_dir):
        rel = os.path.relpath(root, out_dir)
        dirs.update(os.path.normpath(os.path.join(rel, d)) for d in subdirs)
        files.update(os.path.normpath(os.path.join(rel, n)) for n in names)
    files.discard(MANIFEST)
    return files, dirs


def _clear_previous_output(out_dir: str) -> None:
    """Delete what the last explain() into ``out_dir`` wrote (its manifest lists it); refuse
    explain-named files that no manifest lists, before deleting anything."""
    manifest = os.path.join(out_dir, MANIFEST)
    listed: list[str] = []
    if os.path.exists(manifest):
        with open(manifest) as f:
            listed = [line.rstrip("\n") for line in f if line.strip()]
    ours = {os.path.normpath(p) for p in listed}
    files, _ = _listing(out_dir)
    stray = sorted(p for p in files - ours if _OUTPUT_NAME.fullmatch(os.path.basename(p)))
    if stray:
        shown = ", ".join(stray[:3]) + (f" and {len(stray) - 3} more" if len(stray) > 3 else "")
        raise FileExistsError(
            f"gemma4opt.explain: {out_dir} holds files named like explain's output that no earlier "
            f"explain() recorded writing ({shown}); delete them or pass an empty or new out_dir")
    for rel in listed:
        path = os.path.normpath(os.path.join(out_dir, rel))
        if os.path.commonpath([out_dir, path]) != out_dir or path == out_dir:
            continue                                # never outside out_dir, whatever the file says
        if rel.endswith(os.sep):                    # a folder explain made: only if now empty
            if os.path.isdir(path) and not os.listdir(path):
                os.rmdir(path)
        elif os.path.isfile(path) and not os.path.islink(path):
            os.remove(path)
    if os.path.exists(manifest):
        os.remove(manifest)
