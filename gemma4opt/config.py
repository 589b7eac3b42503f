"""Gemma4OptConfig: the one place where a user tunes what optimize() does."""
from __future__ import annotations

import dataclasses

from gemma4opt.patterns import PATTERN_NAMES

_CACHES = ("auto", "dynamic", "static")


@dataclasses.dataclass(frozen=True)
class Gemma4OptConfig:
    """What optimize() does to a model.

    patterns: names of the fusions to apply, in the order of ``gemma4opt.patterns.PATTERN_NAMES``;
        ``None`` means all of them. An empty tuple captures the graph but rewrites nothing.
    inductor: lower the rewritten graph with Inductor. ``None`` = on CUDA only (on CPU the graph
        runs as captured, calling the reference ops, so CPU results equal HF's bit for bit).
        With cuda_graphs, only decode graphs are lowered; prefill runs the rewritten graph as is.
    cuda_graphs: replay decode steps as CUDA graphs (Inductor cudagraph trees over the static
        cache). ``None`` = on when on CUDA with a static cache.
    cache: KV cache ``generate`` uses when the caller passes none. "auto" = "static" on CUDA
        (fixed shapes: one decode graph, no recompiles), "dynamic" on CPU.
    """

    patterns: tuple[str, ...] | None = None
    inductor: bool | None = None
    cuda_graphs: bool | None = None
    cache: str = "auto"

    def __post_init__(self):
        if self.patterns is not None:
            unknown = [p for p in self.patterns if p not in PATTERN_NAMES]
            if unknown:
                raise ValueError(
                    f"Gemma4OptConfig.patterns: unknown pattern(s) {unknown}; supported: {list(PATTERN_NAMES)}"
                )
        if self.cache not in _CACHES:
            raise ValueError(f"Gemma4OptConfig.cache={self.cache!r}; supported: {list(_CACHES)}")

    def enabled_patterns(self) -> tuple[str, ...]:
        if self.patterns is None:
            return PATTERN_NAMES
        return tuple(p for p in PATTERN_NAMES if p in self.patterns)

    def resolve(self, device_type: str) -> "Gemma4OptConfig":
        """Fill the ``None``/"auto" fields for a device."""
        on_cuda = device_type == "cuda"
        cache = self.cache if self.cache != "auto" else ("static" if on_cuda else "dynamic")
        inductor = on_cuda if self.inductor is None else self.inductor
        graphs = (on_cuda and cache == "static") if self.cuda_graphs is None else self.cuda_graphs
        if graphs and not on_cuda:
            raise ValueError("Gemma4OptConfig.cuda_graphs=True needs a CUDA model; this model is on " + device_type)
        if graphs and not inductor:
            raise ValueError("Gemma4OptConfig.cuda_graphs=True needs inductor=True (graphs come from Inductor)")
        return dataclasses.replace(self, cache=cache, inductor=inductor, cuda_graphs=graphs)
