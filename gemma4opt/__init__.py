"""gemma4opt: fast Hugging Face Gemma-4 generation through FX graph rewrites and fused kernels.

    model = gemma4opt.optimize(model)
    out = model.generate(input_ids, max_new_tokens=256)
    gemma4opt.report(model)
"""
from gemma4opt.api import optimize
from gemma4opt.config import Gemma4OptConfig
from gemma4opt.explain import explain
from gemma4opt.report import report
from gemma4opt.warmup import warmup

__all__ = ["optimize", "report", "explain", "warmup", "Gemma4OptConfig"]
__version__ = "0.1.0"
