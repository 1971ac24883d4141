"""sampler-misuse (DD007): set_epoch, epochs across ranks, padding of evaluation samplers.

Unit tests on hand-written traces (the bad/good programs run end to end in tests/e2e)."""

from __future__ import annotations

from support.traces import run_check, write_traces

from ddpdoctor.analysis.checks.sampler_misuse import SamplerMisuse


def it(sid: int, rank: int, epoch: int = 0, created: int = 9, **kw) -> dict:
    """One iteration of a DistributedSampler."""
    rec = {"t": "sampler", "id": sid, "epoch": epoch, "seed": 0, "shuffle": True, "n": 32, "num_samples": 16,
           "total": 32, "replicas": 2, "srank": rank, "drop_last": False, "fp": "f", "data_fp": None,
           "created": ("train.py", created), "site": ("train.py", created + 3)}
    rec.update(kw)
    return rec


def set_epoch(sid: int, epoch: int) -> dict:
    return {"t": "set_epoch", "id": sid, "epoch": epoch, "site": ("train.py", 11)}


def check(tmp_path, ranks, world=None):
    return run_check(SamplerMisuse, write_traces(tmp_path / "t", ranks, world))


def what(findings) -> list[tuple]:
    return sorted((x.data.get("what"), x.severity) for x in findings)


def test_epochs_without_set_epoch_repeat_the_order(tmp_path):
    found = check(tmp_path, {r: [it(5, r), it(5, r), it(5, r)] for r in (0, 1)})
    assert what(found) == [("no-set-epoch", "warning")]
    fd = found[0]
    assert fd.ranks == [0, 1] and fd.data["iterations"] == 3 and "never called" in fd.message
    assert {(loc.role, loc.line) for loc in fd.locations} == {("sampler", 9), ("iteration", 12)}


def test_set_epoch_with_a_constant_and_rebuilt_samplers(tmp_path):
    const = {r: [set_epoch(5, 0), it(5, r), set_epoch(5, 0), it(5, r)] for r in (0, 1)}
    found = check(tmp_path, const)
    assert what(found) == [("no-set-epoch", "warning")] and "always with 0" in found[0].message
    rebuilt = {r: [it(5, r), it(6, r), it(7, r)] for r in (0, 1)}  # a new sampler each epoch
    found = check(tmp_path / "b", rebuilt)
    assert what(found) == [("no-set-epoch", "warning")] and "rebuilt" in found[0].message


def test_silent_cases(tmp_path):
    one_epoch = {r: [it(5, r)] for r in (0, 1)}
    advancing = {r: [x for e in range(3) for x in (set_epoch(5, e), it(5, r, e), it(5, r, e))] for r in (0, 1)}
    no_shuffle = {r: [it(5, r, shuffle=False, n=32), it(5, r, shuffle=False, n=32)] for r in (0, 1)}
    new_seed_each_time = {r: [it(5 + s, r, seed=s) for s in range(3)] for r in (0, 1)}
    for i, ranks in enumerate((one_epoch, advancing, no_shuffle, new_seed_each_time)):
        assert check(tmp_path / str(i), ranks) == [], i


def test_a_peek_before_the_loop_is_no_epoch(tmp_path):
    """`next(iter(loader))` (a peek at the first batch) iterates the sampler once at its own line:
    with the one epoch that follows it is no repeated order (issue 15)."""
    peek = {r: [it(5, r, site=("train.py", 20)), it(5, r, site=("train.py", 24))] for r in (0, 1)}
    assert check(tmp_path, peek) == []
    # two real epochs at the loop's line still repeat the order, peek or not
    two = {r: [it(5, r, site=("train.py", 20)), it(5, r, site=("train.py", 24)), it(5, r, site=("train.py", 24))]
           for r in (0, 1)}
    assert what(check(tmp_path / "b", two)) == [("no-set-epoch", "warning")]


def test_epochs_that_differ_across_ranks(tmp_path):
    ranks = {0: [set_epoch(5, 0), it(5, 0, 0), set_epoch(5, 1), it(5, 0, 1)],
             1: [set_epoch(5, 0), it(5, 1, 0), set_epoch(5, 2), it(5, 1, 2)],
             2: [set_epoch(5, 0), it(5, 2, 0), set_epoch(5, 1), it(5, 2, 1)]}
    found = check(tmp_path, ranks, world=3)
    assert what(found) == [("epoch-mismatch", "error")] and found[0].ranks == [1]
    # a rank that iterates once more (not the same iteration any more) is not compared
    extra = {0: [it(5, 0, 0), it(5, 0, 1)], 1: [it(5, 1, 0), it(5, 1, 1), it(5, 1, 2)]}
    assert [x for x in check(tmp_path / "b", extra) if x.data["what"] == "epoch-mismatch"] == []


def test_evaluation_sampler_padding(tmp_path):
    ranks = {r: [it(5, r, shuffle=False, n=11, total=12, num_samples=6)] for r in (0, 1)}
    found = check(tmp_path, ranks)
    assert what(found) == [("padding", "warning")]
    assert found[0].data["duplicates"] == 1 and "given to rank 1" in found[0].message
    for i, kw in enumerate(({"n": 12}, {"n": 11, "drop_last": True}, {"n": 11, "shuffle": True})):
        kw = {"shuffle": False, **kw}
        assert check(tmp_path / str(i), {r: [it(5, r, **kw)] for r in (0, 1)}) == [], kw


def test_many_ranks(tmp_path):
    world = 256
    ranks = {r: [it(5, r, shuffle=False, n=1000, replicas=world), it(6, r, 0, created=30),
                 it(6, r, 0, created=30)] for r in range(world)}
    found = check(tmp_path, ranks, world)
    assert what(found) == [("no-set-epoch", "warning"), ("padding", "warning")]
    pad = next(x for x in found if x.data["what"] == "padding")
    assert pad.data["duplicates"] == 24 and "ranks 232-255" in pad.message  # 1000 -> 1024
