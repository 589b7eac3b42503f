"""HostStaging: a step's arrays packed into one int32 buffer and handed out as views."""
import numpy as np
import torch

from gemma4opt.paged.staging import HostStaging


def test_views_hold_each_array_and_one_copy_per_step():
    st = HostStaging("cpu", capacity=8)
    rng = np.random.default_rng(0)
    for step in range(4):
        arrays = {"a": rng.integers(0, 100, size=3 + step), "empty": np.zeros(0, dtype=np.int64),
                  "b": rng.integers(0, 1 << 20, size=(2, 5)).astype(np.int64), "c": np.array([7], dtype=np.int32)}
        out = st.stage(arrays)
        for name, a in arrays.items():
            assert out[name].dtype == torch.int32 and tuple(out[name].shape) == np.shape(a)
            assert np.array_equal(out[name].numpy(), a)
        assert st.copies == step + 1
    assert st.capacity >= 3 + 3 + 10 + 1, "grows past its first capacity"


def test_a_repeated_layout_reuses_its_views_with_the_new_contents():
    st = HostStaging("cpu", capacity=64)
    first = st.stage({"lens": np.array([3, 4]), "slots": np.array([9, 10])})
    again = st.stage({"lens": np.array([4, 5]), "slots": np.array([10, 11])})
    assert again["lens"] is first["lens"]                     # decode steps: no new views per step
    assert again["lens"].tolist() == [4, 5] and again["slots"].tolist() == [10, 11]
    other = st.stage({"lens": np.array([1, 2, 3])})            # another layout: its own views
    assert other["lens"].tolist() == [1, 2, 3]
