"""unseeded-rng (DD004), Python / NumPy randomness: seeds and the draws made while setting up.

Hand-written traces of the ``seed`` (gen python/numpy) and ``rng`` records of rank/patches/pyrng.py;
the programs run end to end in tests/e2e/test_rng_bn_runs.py."""

from __future__ import annotations

from support.traces import run_check, write_run

from ddpdoctor.analysis.checks.unseeded_rng import UnseededRng

LOOP = ["train.py", 30, "for step in range(10):", "for"]


def seed(value, gen: str = "python", line: int = 5) -> dict:
    call = {"python": "random.seed", "numpy": "np.random.seed", "torch": "torch.manual_seed"}[gen]
    return {"t": "seed", "gen": gen, "value": value, "site": ("train.py", line, f"{call}(rank)")}


def draw(out: str, inp: str = "in", fn: str = "shuffle", gen: str = "python", line: int = 9,
         conds: tuple = ()) -> dict:
    return {"t": "rng", "op": "draw", "gen": gen, "fn": fn, "in": inp, "out": out,
            "site": ("train.py", line, f"random.{fn}(files)", [list(c) for c in conds])}


def end(conds: tuple = (LOOP,), line: int = 31) -> dict:
    return {"t": "rng", "op": "end", "why": "forward", "draws": 1, "site": ("train.py", line, "model(x)",
                                                                            [list(c) for c in conds])}


def check(tmp_path, ranks):
    return run_check(UnseededRng, write_run(tmp_path / "t", ranks))


def kinds(found) -> list[tuple]:
    return sorted((f.data.get("what"), f.data.get("fn"), f.severity) for f in found)


def test_shuffle_of_the_same_list_seeded_by_rank_is_an_error_with_the_seed(tmp_path):
    found = check(tmp_path, {r: [seed(r), draw(f"o{r}"), end()] for r in (0, 1)})
    assert kinds(found) == [("draw", "shuffle", "error")]  # the seed is cited, not repeated as info
    f = found[0]
    assert "random.shuffle at train.py:9" in f.message and "random.seed at train.py:5" in f.message
    assert "rank 0: 0; rank 1: 1" in f.message and f.data["seeded"] == "rank"
    assert {(loc.role, loc.line) for loc in f.locations} == {("draw", 9), ("seed", 5)}


def test_never_seeded_numpy_permutation_is_an_error(tmp_path):
    found = check(tmp_path, {r: [draw(f"o{r}", fn="permutation", gen="numpy"), end()] for r in (0, 1)})
    assert kinds(found) == [("draw", "permutation", "error")]
    assert "np.random.permutation" in found[0].message and "never seeded (np.random.seed)" in found[0].message
    assert found[0].data["seeded"] == "never"


def test_same_seed_consumed_differently_blames_the_odd_rank(tmp_path):
    ranks = {r: [seed(7), draw("o1" if r == 2 else "o0"), end()] for r in (0, 1, 2)}
    found = check(tmp_path, ranks)
    assert kinds(found) == [("draw", "shuffle", "error")]
    assert found[0].ranks == [2] and found[0].data["seeded"] == "same"
    assert "same on every rank" in found[0].message


def test_values_are_info_and_choices_warnings_unless_something_that_must_agree_differs(tmp_path):
    def ranks(fn, **kw):
        return {r: [seed(r), draw(f"v{r}", fn=fn, inp="(16, 64)", **kw), end()] for r in (0, 1)}

    assert kinds(check(tmp_path / "a", ranks("randint"))) == [("draw", "randint", "info")]
    assert kinds(check(tmp_path / "b", ranks("choice"))) == [("draw", "choice", "warning")]
    # characters picked (a run name): a value, not a selection of data or of a model
    chars = {r: [draw(f"v{r}", fn="choices", inp="abc"), end()] for r in (0, 1)}
    for recs in chars.values():
        recs[0]["ty"] = "str"
    assert kinds(check(tmp_path / "c", chars)) == [("draw", "choices", "info")]
    # a rank failed (DDP refuses models whose parameters differ): the choice is the likely cause
    failed = ranks("choice")
    out = run_check(UnseededRng, write_run(tmp_path / "d", failed, exits={1: {"t": "exit", "how": "exception",
                                                                               "exc": "RuntimeError: DDP"}}))
    assert kinds(out) == [("draw", "choice", "error")]
    out = run_check(UnseededRng, write_run(tmp_path / "e", ranks("randint"), exits={1: None}))  # killed
    assert kinds(out) == [("draw", "randint", "warning")]


def test_own_shard_shuffled_per_rank_is_silent(tmp_path):
    # each rank shuffles a different list (its shard): intended, only the seed is info
    found = check(tmp_path, {r: [seed(r), draw(f"o{r}", inp=f"shard{r}"), end()] for r in (0, 1)})
    assert kinds(found) == [("seed", None, "info")]
    assert "random.seed at train.py:5" in found[0].message and "Python's global generator" in found[0].message


def test_identical_draws_are_silent(tmp_path):
    assert check(tmp_path, {r: [seed(3), draw("same"), end()] for r in (0, 1)}) == []


def test_augmentation_drawn_in_the_training_loop_before_the_first_forward_is_silent(tmp_path):
    # the first step draws its augmentation before its forward: the same loop as the window's end
    ranks = {r: [seed(1000 + r), draw(f"o{r}", fn="choice", line=32, conds=(LOOP,)),
                 draw(f"v{r}", fn="random", line=33, conds=(LOOP,)), end()] for r in (0, 1)}
    assert kinds(check(tmp_path, ranks)) == [("seed", None, "info")]


def test_draw_in_a_setup_loop_is_still_compared(tmp_path):
    setup_loop = ["train.py", 8, "for name in sources:", "for"]
    ranks = {r: [draw(f"o{r}", conds=(setup_loop,)), end()] for r in (0, 1)}
    assert kinds(check(tmp_path, ranks)) == [("draw", "shuffle", "error")]


def test_python_seeds_are_not_the_cause_of_a_torch_split(tmp_path):
    split = {"t": "split", "n": 40, "parts": [32, 8], "gen": "default", "site": ("train.py", 8)}
    ranks = {r: [seed(5, gen="torch", line=4), seed(r, line=5), dict(split, fp=[f"a{r}", f"b{r}"])]
             for r in (0, 1)}
    found = check(tmp_path, ranks)
    sp = [f for f in found if f.data.get("what") == "split"]
    assert sp and "random.seed" not in sp[0].message and "same" in sp[0].message


def test_damaged_records_give_no_traceback(tmp_path):
    bad = {"t": "rng", "op": "draw", "gen": "python", "fn": ["x"], "in": [1, 2], "out": {"a": 1},
           "site": ("train.py", 9)}
    ranks = {r: [dict(seed(r), value=[r]), dict(bad, out=[r]), {"t": "rng", "op": "end", "site": "?"}] for r in (0, 1)}
    found = check(tmp_path, ranks)
    assert [f.data.get("what") for f in found] == ["draw"]  # the seed is cited there
    found = check(tmp_path / "b", {r: [dict(seed(r), value=[r])] for r in (0, 1)})
    assert [f.data.get("what") for f in found] == ["seed"]


def test_values_a_library_draws_for_itself_are_silent_but_its_selections_are_not(tmp_path):
    from support.traces import write_rank

    from ddpdoctor.analysis.checks.unseeded_rng import UnseededRng as Check
    from ddpdoctor.trace import records

    def recs(r, fn):
        lib = records.site(1, "/src/train.py", 12, "main", "port = pick_port()", via="somelib util.py:40")
        return [lib, {"t": "rng", "op": "draw", "gen": "python", "fn": fn, "in": "i", "out": f"o{r}", "ts": 5, "site": 1}]

    for fn, want in (("randint", []), ("shuffle", ["draw"])):
        folder = tmp_path / fn
        for r in (0, 1):
            write_rank(folder, r, 2, recs(r, fn))
        assert [f.data.get("what") for f in run_check(Check, folder)] == want


def test_a_sampler_over_differing_subsets_names_the_setup_permutation(tmp_path):
    sampler = {"t": "sampler", "id": 1, "epoch": 0, "seed": 0, "shuffle": False, "n": 32, "num_samples": 16,
               "total": 32, "replicas": 2, "drop_last": False, "fp": "f", "created": ("train.py", 20),
               "site": ("train.py", 22)}
    ranks = {r: [seed(r, gen="numpy"), draw(f"o{r}", fn="permutation", gen="numpy", line=12),
                 dict(sampler, srank=r, data_fp=f"d{r}"), end()] for r in (0, 1)}
    found = check(tmp_path, ranks)
    samp = [f for f in found if f.data.get("what") == "sampler"]
    assert samp and "np.random.permutation at train.py:12" in samp[0].message
    assert ("draw", 12) in {(loc.role, loc.line) for loc in samp[0].locations}
    assert kinds(found) == [("draw", "permutation", "error"), ("sampler", None, "error")]
