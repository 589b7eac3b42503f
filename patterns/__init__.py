"""The fusions, in the order the pass manager applies them.

Each pattern is one file here; ``PATTERNS`` maps its name to an instance. Later patterns
match on the ops earlier ones produced (e.g. a residual tail matches two gemma4opt.rms_norm
calls around an add), so order matters.
"""
from __future__ import annotations

PATTERN_NAMES = ("rms_norm",)


def build_patterns() -> dict:
    from .rms_norm import RMSNormPattern

    patterns = [RMSNormPattern()]
    return {p.name: p for p in patterns}
