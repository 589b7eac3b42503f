"""transformers' own FineGrainedFP8 path on a machine that cannot reach the Hugging Face Hub.

An FP8Linear of a model loaded with ``FineGrainedFP8Config`` runs its matmul through the
``kernels-community/finegrained-fp8`` Triton kernel, which transformers downloads from the Hub on
first use (or DeepGEMM, also from the Hub). The GPU machines here have no network, so HF's FP8 path
cannot run there as shipped. This loads the same kernel's Python package from a local copy of its
source (the ``torch-ext/finegrained_fp8`` folder of github.com/huggingface/kernels-community,
Apache-2.0; build version 4, the version transformers 5.17 asks for) and puts it where transformers
keeps the kernel it loaded (``finegrained_fp8._FINEGRAINED_FP8``), so that FP8Linear's own forward
runs it, DeepGEMM left out. Benchmarks only: this sets a transformers module global in the
benchmark's process.

    cp -r <kernels-community>/finegrained-fp8/torch-ext/finegrained_fp8 .hfkernels/
    python benchmarks/bench_generate.py --preset e4b --systems hf-fp8-static gemma4opt-fp8
"""
from __future__ import annotations

import importlib.util
import os
import sys
import types

DEFAULT_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".hfkernels",
                            "finegrained_fp8")
_PACKAGE = "finegrained_fp8_local"


def _ops_module(name: str) -> types.ModuleType:
    """The ``_ops`` module kernel-builder generates for a build (absent from the source): the
    namespace its ``triton_op``s register under."""
    import torch

    mod = types.ModuleType(f"{name}._ops")
    namespace = f"_{name}"
    mod.ops = getattr(torch.ops, namespace)
    mod.add_op_namespace_prefix = lambda op_name: f"{namespace}::{op_name}"
    return mod


def load(path: str | None = None) -> types.ModuleType:
    """The kernel package at ``path`` (default .hfkernels/finegrained_fp8), imported once and made
    transformers' loaded finegrained-fp8 kernel. A clear error when it is not there."""
    from transformers.integrations import finegrained_fp8 as hf

    path = os.path.abspath(path or DEFAULT_PATH)
    pkg = sys.modules.get(_PACKAGE)
    if pkg is None or getattr(pkg, "_loaded_from", None) != path:
        for name in [n for n in sys.modules if n == _PACKAGE or n.startswith(_PACKAGE + ".")]:
            del sys.modules[name]
        init = os.path.join(path, "__init__.py")
        if not os.path.isfile(init):
            raise FileNotFoundError(
                f"no finegrained-fp8 kernel package at {path}: copy the torch-ext/finegrained_fp8 folder of "
                "github.com/huggingface/kernels-community there (HF's FP8 path cannot download it offline)")
        sys.modules[f"{_PACKAGE}._ops"] = _ops_module(_PACKAGE)
        spec = importlib.util.spec_from_file_location(_PACKAGE, init, submodule_search_locations=[path])
        pkg = importlib.util.module_from_spec(spec)
        sys.modules[_PACKAGE] = pkg
        spec.loader.exec_module(pkg)
        pkg._loaded_from = path
    hf._FINEGRAINED_FP8 = hf.FineGrainedFP8(matmul=pkg.matmul_2d, batched_matmul=pkg.matmul_batched,
                                            grouped_matmul=pkg.matmul_grouped)
    # DeepGEMM also comes from the Hub; its probe would look for it on every call.
    os.environ["TRANSFORMERS_DISABLE_DEEPGEMM_LINEAR"] = "1"
    return pkg
