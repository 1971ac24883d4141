"""The fast path's cache key (rank/patches/fastpath.py): what decides a call's record, read
per number of positional arguments, and a hit only for a call that would be described alike."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from ddpdoctor.rank.patches import dist as patch_dist  # noqa: E402
from ddpdoctor.rank.patches import fastpath  # noqa: E402


def _all_reduce(tensor, op="SUM", group=None, async_op=False):
    """The shape of torch's all_reduce signature."""


def _key():
    params, defaults = patch_dist._signature(_all_reduce)
    return fastpath.key_function(params, defaults, ("tensor",), ("group", "op", "async_op"),
                                 patch_dist._ABSENT)


def test_same_shape_same_key_other_shape_other_key():
    key = _key()
    a, b = torch.ones(2), torch.zeros(2)
    assert key((a,), {}, 1, 2, 3) == key((b,), {}, 1, 2, 3)  # values never matter
    assert key((a,), {}, 1, 2, 3) != key((torch.ones(3),), {}, 1, 2, 3)
    assert key((a,), {}, 1, 2, 3) != key((a.double(),), {}, 1, 2, 3)
    assert key((a,), {}, 1, 2, 3) != key((a,), {}, 1, 2, 4)  # another call site
    assert key((a,), {}, 1, 2, 3) != key((a, "MAX"), {}, 1, 2, 3)


def test_keyword_forms_read_every_parameter():
    key = _key()
    t = torch.ones(1)
    k = key((t,), {"op": "MAX"}, 0, 0, 0)
    assert k != key((t,), {"op": "MIN"}, 0, 0, 0)
    assert k != key((t,), {}, 0, 0, 0)
    assert key((), {"tensor": t}, 0, 0, 0) != key((), {"tensor": torch.ones(2)}, 0, 0, 0)


def test_unkeyable_arguments_raise_for_the_general_path():
    key = _key()
    with pytest.raises(AttributeError):
        key(("not a tensor",), {}, 0, 0, 0)
    with pytest.raises(TypeError):
        hash(key((torch.ones(1), "SUM", [1]), {}, 0, 0, 0))  # an unhashable group
