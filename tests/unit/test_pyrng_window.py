"""rank/patches/pyrng.py: digests of draw inputs and results (the window itself is tested in a
fresh interpreter in tests/e2e/test_rng_bn_runs.py: the patch changes process-wide modules)."""

from __future__ import annotations


def test_digest_is_by_value_for_plain_data_and_by_type_otherwise():
    from ddpdoctor.rank.patches.pyrng import digest

    assert digest(["a", 1, (2.5, None)]) == digest(["a", 1, (2.5, None)])
    assert digest(["a", "b"]) != digest(["b", "a"])
    assert digest([object()]) == digest([object()])  # addresses never enter a digest
