"""InstanceEdits: what optimize() set on an instance, taken back for good (revert), for a block
(lifted: a deep copy), or in a copy of the instance's attributes (state_before: its pickled state)."""
import torch

from gemma4opt.edits import InstanceEdits


def _edited():
    module = torch.nn.Linear(2, 2)
    module.note = "the caller's"
    edits = InstanceEdits()
    edits.set(module, "forward", "first")
    edits.set(module, "forward", "second")      # the same name twice: what was there before the first comes back
    edits.set(module, "note", "ours")
    edits.set(module, "config", "own copy")
    return module, edits


def test_state_before_is_the_attributes_before_the_first_edit_with_kept_names_as_they_are():
    module, edits = _edited()
    state = edits.state_before(module, keep=("config",))
    assert "forward" not in state and state["note"] == "the caller's" and state["config"] == "own copy"
    assert vars(module)["forward"] == "second" and module.note == "ours"       # the instance unchanged
    assert state["_parameters"] is vars(module)["_parameters"]


def test_lifted_takes_the_edits_off_for_the_block_only():
    module, edits = _edited()
    with edits.lifted(keep=("config",)):
        assert "forward" not in vars(module) and module.note == "the caller's" and module.config == "own copy"
    assert vars(module)["forward"] == "second" and module.note == "ours"
    edits.revert()
    assert "forward" not in vars(module) and module.note == "the caller's" and "config" not in vars(module)


def test_objects_are_the_live_edited_ones_each_once():
    module, edits = _edited()
    other = torch.nn.ReLU()
    edits.set(other, "forward", "x")
    assert edits.objects() == [module, other]
    del other
    assert edits.objects() == [module]          # modules are held weakly
