"""Tensor parallelism: one Gemma-4 model split across the ranks of a torch.distributed group,
by gemma4opt, on the model instance (``Gemma4OptConfig(tensor_parallel=True)`` under torchrun).

Megatron's split, per rank, in place at optimize() (before anything is captured):
- attention: q_proj's rows and o_proj's columns of this rank's query heads (heads / world);
  k_proj / v_proj's rows of its KV heads, kv_heads / world where that divides, else (fewer KV
  heads than ranks, e.g. one global KV head) the one KV head its query heads read, replicated;
- dense MLP: gate_proj / up_proj rows and down_proj columns of intermediate / world;
- MoE experts: the gate and up halves of gate_up_proj and down_proj's columns of
  moe_intermediate / world (the router is replicated: each rank routes every token alike);
- embeddings, norms, the lm_head and the per-layer-input (PLE) weights: replicated.

Each rank's attention output (after o_proj), dense-MLP output (after down_proj) and experts'
output is its share of a sum, and a norm follows each: a forward hook all-reduces it through
torch's functional collectives (Dynamo traces them, so they are in the captured graph and in
CUDA graphs). Every rank runs the same generate on the same inputs; logits are replicated.

The config keeps the whole model's counts (it answers as HF's does); the paged pool and its
backends read this rank's through ``local_heads`` / ``local_kv_heads`` with the model's ``Shard``
(``OptimizationState.shard``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

@dataclass(frozen=True)
class Shard:
    rank: int
    world: int
    group: object = None      # the process group (None: the default one)

    def describe(self) -> str:
        return f"rank {self.rank} of {self.world}"


def _kv_split(kv_heads: int, world: int, rank: int) -> tuple[int, int]:
    """(first KV head, count) this rank keeps."""
    if kv_heads % world == 0:
        n = kv_heads // world
        return rank * n, n
    return rank * kv_heads // world, 1          # replicated: the KV head this rank's query heads read


def local_heads(text_config, shard: Shard | None) -> int:
    """Query heads on this rank (all of them without a shard)."""
    return text_config.num_attention_heads // (shard.world if shard else 1)


def local_kv_heads(text_config, layer: int, shard: Shard | None) -> int:
    """KV heads of ``layer`` on this rank."""
    kv = text_config.per_layer_config[layer].num_key_value_heads
    return _kv_split(kv, shard.world, shard.rank)[1] if shard else kv


def unsupported(text_config, world: int) -> str | None:
    """Why this model cannot be split over ``world`` ranks, or None."""
    heads = text_config.num_attention_heads
    if heads % world:
        return f"{heads} attention heads do not split over {world} ranks"
    for layer in range(text_config.num_hidden_layers):
        kv = text_config.per_layer_config[layer].num_key_value_heads
        if kv % world and world % kv:
            return f"layer {layer}'s {kv} KV heads neither split over {world} ranks nor divide {world}"
    widths = {"intermediate_size": text_config.intermediate_size}
    if getattr(text_config, "enable_moe_block", False):
        widths["moe_intermediate_size"] = text_config.moe_intermediate_size
    for name, width in widths.items():
        if width % world:
            return f"{name}={width} does not split over {world} ranks"
    return None


def _rows(t: torch.Tensor, start: int, count: int, dim: int = 0) -> torch.nn.Parameter:
    return torch.nn.Parameter(t.detach().narrow(dim, start, count).contiguous(), requires_grad=t.requires_grad)


def _all_reduce_output(group):
    from torch.distributed import _functional_collectives as funcol

    def hook(module, args, output):
        if isinstance(output, tuple):       # attention: (output, weights)
            return (funcol.all_reduce(output[0], "sum", group), *output[1:])
        return funcol.all_reduce(output, "sum", group)
    return hook


SHARD_ATTR = "_gemma4opt_shard"      # on a split model: its Shard (the split outlives optimize's edits)


def sharded(target: torch.nn.Module) -> Shard | None:
    """The Shard ``target`` was split by, or None."""
    return getattr(target, SHARD_ATTR, None)


def plan_shard(text_config, group=None) -> Shard:
    """This process's Shard of the default (or given) process group, checked against the model;
    nothing is changed yet."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("Gemma4OptConfig.tensor_parallel=True needs torch.distributed initialized before "
                         "optimize() (under torchrun: torch.distributed.init_process_group())")
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if world < 2:
        raise ValueError("Gemma4OptConfig.tensor_parallel=True: the process group has one rank; run under "
                         "torchrun --nproc-per-node N with N >= 2")
    why = unsupported(text_config, world)
    if why is not None:
        raise ValueError(f"gemma4opt tensor_parallel over {world} ranks: {why}")
    return Shard(rank, world, group)


def shard_model(target: torch.nn.Module, text_config, shard: Shard) -> None:
    """Split ``target`` (a Gemma-4 text model or causal LM) in place for ``shard`` (see the module
    doc). Irreversible: the other ranks' weights are dropped."""
    import torch.distributed as dist

    world, rank = shard.world, shard.rank
    heads = text_config.num_attention_heads
    hook = _all_reduce_output(shard.group if shard.group is not None else dist.group.WORLD)
    for module in target.modules():
        kind = type(module).__name__
        if kind == "Gemma4TextAttention":
            d = module.head_dim
            q_start, q_n = rank * heads // world, heads // world
            module.q_proj.weight = _rows(module.q_proj.weight, q_start * d, q_n * d)
            module.o_proj.weight = _rows(module.o_proj.weight, q_start * d, q_n * d, dim=1)
            kv = text_config.per_layer_config[module.layer_idx].num_key_value_heads
            kv_start, kv_n = _kv_split(kv, world, rank)
            for name in ("k_proj", "v_proj"):
                lin = getattr(module, name, None)
                if isinstance(lin, torch.nn.Linear):
                    lin.weight = _rows(lin.weight, kv_start * d, kv_n * d)
            module.num_key_value_groups = q_n // kv_n
            module.register_forward_hook(hook)
        elif kind == "Gemma4TextMLP":
            n = module.gate_proj.weight.shape[0] // world
            module.gate_proj.weight = _rows(module.gate_proj.weight, rank * n, n)
            module.up_proj.weight = _rows(module.up_proj.weight, rank * n, n)
            module.down_proj.weight = _rows(module.down_proj.weight, rank * n, n, dim=1)
            module.intermediate_size = n
            module.register_forward_hook(hook)
        elif kind == "Gemma4TextExperts":
            n = module.intermediate_dim // world
            gate, up = module.gate_up_proj.detach().chunk(2, dim=1)
            module.gate_up_proj = torch.nn.Parameter(
                torch.cat([gate.narrow(1, rank * n, n), up.narrow(1, rank * n, n)], dim=1).contiguous(),
                requires_grad=module.gate_up_proj.requires_grad)
            module.down_proj = _rows(module.down_proj, rank * n, n, dim=2)
            module.intermediate_dim = n
            module.register_forward_hook(hook)
    setattr(target, SHARD_ATTR, shard)
