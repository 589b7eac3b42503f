"""copy.deepcopy, copy.copy and pickle of an optimized model, as HF's model answers them.

Python copies and pickles an object's instance attributes as they are, and optimize() set some on
the model and its modules: entry points whose closures hold the model's state (compiled graphs, KV
pool, weights), and the paged attention's step context. Kept in a deep copy, they made the copy run
the original's weights, silently; in a pickle, pickle stopped at them with an error naming an HF
function. So every object optimize() edited answers ``__getstate__`` with its attributes as they
were before (InstanceEdits.state_before; its own config copies kept), and the model itself is
optimized again on the other side with the same config: a deep copy by ``__deepcopy__``, a pickle
by the state setter of its ``__reduce_ex__``. A copy or pickle of a submodule is HF's module.
"""
from __future__ import annotations

import copy
import copyreg
import functools
import sys

from gemma4opt.edits import InstanceEdits

# Kept as they are: the model's own config copies (the caller's edits to them stay); optimizing the
# copy makes its own copies of them again.
KEPT = ("config", "generation_config")
PICKLED = "_gemma4opt_pickled"      # in a pickled model's state: (the config given to optimize(), gen_written)


def install_copying(model, edits: InstanceEdits, optimize_again, unpickled) -> None:
    """Last in optimize(), once every other edit is made. ``optimize_again(model, config, gen_written)``
    optimizes a copy; ``unpickled(model, state)``, importable by name, is a pickle's state setter."""
    edits.set(model, "__deepcopy__", functools.partial(_deepcopy, model, optimize_again))
    edits.set(model, "__reduce_ex__", functools.partial(_reduce_ex, model, unpickled))
    for obj in edits.objects():
        edits.set(obj, "__getstate__", functools.partial(edits.state_before, obj, KEPT))


def _deepcopy(model, optimize_again, memo):
    state = _refuse_sharded(model, "copy")
    with state.edits.lifted(keep=KEPT):         # HF's deepcopy of the module tree as it is now
        twin = copy.deepcopy(model, memo)
    optimize_again(twin, state.user_config, dict(state.gen_written))
    return twin


def _reduce_ex(model, unpickled, protocol):
    if sys._getframe(1).f_globals.get("__name__") == "copy":
        # copy.copy: Python's shallow copy, a new instance sharing this one's attributes (its modules
        # and weights, and so its optimized entry points and state). copy.deepcopy has __deepcopy__.
        return copyreg.__newobj__, (type(model),), dict(model.__dict__)
    state = _refuse_sharded(model, "pickle")
    pickled = model.__getstate__()
    pickled[PICKLED] = (state.user_config, dict(state.gen_written))
    return copyreg.__newobj__, (type(model),), pickled, None, None, unpickled


def _refuse_sharded(model, what: str):
    state = model._gemma4opt
    if state.shard is not None:
        raise NotImplementedError(f"gemma4opt: a model optimized with tensor_parallel=True holds this rank's share of "
                                  f"the weights and its process group; {what} the model before optimize()")
    return state
