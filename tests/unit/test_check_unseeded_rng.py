"""unseeded-rng (DD004): splits, samplers and initial parameters that differ across ranks.

Unit tests on hand-written traces (the bad/good programs run end to end in tests/e2e)."""

from __future__ import annotations

from support.traces import run_check, write_traces

from ddpdoctor.analysis.checks.unseeded_rng import UnseededRng


def seed(value: int, line: int = 5) -> dict:
    return {"t": "seed", "gen": "torch", "value": value, "site": ("train.py", line, "torch.manual_seed(rank)")}


def split(fps: list[str], gen: str = "default", line: int = 8) -> dict:
    return {"t": "split", "n": 40, "parts": [32, 8], "fp": fps, "gen": gen, "site": ("train.py", line)}


def sampler(sid: int, rank: int, **kw) -> dict:
    rec = {"t": "sampler", "id": sid, "epoch": 0, "seed": 0, "shuffle": True, "n": 32, "num_samples": 16,
           "total": 32, "replicas": 2, "srank": rank, "drop_last": False, "fp": f"f{rank}",
           "data_fp": None, "created": ("train.py", 9), "site": ("train.py", 12)}
    rec.update(kw)
    return rec


def optim(at: str, oid: int, fp: str, gfp: str | None = None, in_ddp: int = 0, nparams: int = 2,
          **kw) -> dict:
    rec = {"t": "optim", "at": at, "id": oid, "cls": "SGD", "nparams": nparams, "fp": fp, "in_ddp": in_ddp,
           "site": ("train.py", 11 if at == "init" else 20), **kw}
    if gfp is not None:
        rec["gfp"] = gfp
    return rec


def check(tmp_path, ranks):
    return run_check(UnseededRng, write_traces(tmp_path / "t", ranks))


def what(findings) -> list[tuple]:
    return sorted((x.data.get("what"), x.severity) for x in findings)


def test_split_feeding_a_sampler_is_an_error_with_its_seed(tmp_path):
    ranks = {r: [seed(r), split([f"a{r}", f"b{r}"]), sampler(50 + r, r, data_fp=f"a{r}")] for r in (0, 1)}
    found = check(tmp_path, ranks)
    assert what(found) == [("split", "error")]  # the sampler's differing subset is this split's
    fd = found[0]
    assert "random_split at train.py:8" in fd.message and "default torch generator" in fd.message
    assert "torch.manual_seed at train.py:5" in fd.message and "rank 0: 0; rank 1: 1" in fd.message
    assert {(loc.role, loc.line) for loc in fd.locations} == {("split", 8), ("seed", 5)}
    assert fd.data["feeds_sampler"] == [0, 1]


def test_split_alone_is_a_warning_and_explicit_generator_is_named(tmp_path):
    ranks = {r: [split([f"a{r}", f"b{r}"], gen="explicit")] for r in (0, 1)}
    found = check(tmp_path, ranks)
    assert what(found) == [("split", "warning")]
    assert "generator passed to it" in found[0].message and "manual_seed" not in found[0].message


def test_identical_splits_and_samplers_are_silent(tmp_path):
    ranks = {r: [seed(7), split(["a", "b"]), sampler(50 + r, r, data_fp="a"),
                 sampler(50 + r, r, epoch=1)] for r in (0, 1)}
    assert check(tmp_path, ranks) == []


def test_sampler_seed_length_and_subset_differences(tmp_path):
    ranks = {0: [sampler(1, 0, seed=0, n=32, data_fp="x")], 1: [sampler(2, 1, seed=1, n=30, data_fp="y")]}
    found = check(tmp_path, ranks)
    assert what(found) == [("sampler", "error")]
    msg = found[0].message
    assert "seed differs" in msg and "dataset length differs" in msg and "Subset indices differ" in msg
    # without shuffling the seed is irrelevant; one replica per rank shards nothing across ranks
    assert check(tmp_path / "b", {r: [sampler(r, r, seed=r, shuffle=False)] for r in (0, 1)}) == []
    assert check(tmp_path / "c", {r: [sampler(r, 0, replicas=1, n=10 + r)] for r in (0, 1)}) == []


def test_model_initialised_per_rank_with_gradients_averaged_is_an_error(tmp_path):
    ranks = {r: [seed(r), optim("init", 9, f"p{r}"), optim("step", 9, f"p{r}", gfp="same")] for r in (0, 1)}
    found = check(tmp_path, ranks)
    assert what(found) == [("model-init", "error")]
    assert found[0].data["grads_synced"] is True and "train.py:11" in found[0].message
    assert {loc.role for loc in found[0].locations} == {"optimizer", "seed"}


def test_model_init_differences_that_are_not_errors(tmp_path):
    # gradients differ too: independent models per rank (intended or not) -> info only
    indep = {r: [optim("init", 9, f"p{r}"), optim("step", 9, f"p{r}", gfp=f"g{r}")] for r in (0, 1)}
    assert what(check(tmp_path, indep)) == [("model-init", "info")]
    # broadcast (or DDP) before the first step: the step record agrees -> silent
    synced = {r: [optim("init", 9, f"p{r}"), optim("step", 9, "p0", gfp="same")] for r in (0, 1)}
    assert check(tmp_path / "b", synced) == []
    in_ddp = {r: [optim("init", 9, f"p{r}", in_ddp=2)] for r in (0, 1)}
    assert check(tmp_path / "c", in_ddp) == []
    stages = {r: [optim("step", 9, f"p{r}", gfp="same", nparams=2 + r)] for r in (0, 1)}  # pipeline stages
    assert check(tmp_path / "d", stages) == []
    fsdp = {r: [optim("step", 9, f"p{r}", gfp="same", sharded=True)] for r in (0, 1)}  # shards by design
    assert check(tmp_path / "e", fsdp) == []


def test_rank_dependent_seed_alone_is_informational(tmp_path):
    found = check(tmp_path, {r: [seed(100 + r)] for r in (0, 1)})
    assert what(found) == [("seed", "info")] and found[0].locations[0].line == 5
    assert check(tmp_path / "b", {r: [seed(3)] for r in (0, 1)}) == []


def test_many_ranks_one_minority(tmp_path):
    world = 256
    ranks = {r: [split(["a", "b"] if r != 77 else ["c", "d"])] for r in range(world)}
    found = check(tmp_path, ranks)
    assert what(found) == [("split", "warning")] and found[0].ranks == [77]
