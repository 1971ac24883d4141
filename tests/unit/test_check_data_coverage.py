"""data-coverage (DD017) on hand-written traces, and the index-set encoding both sides share."""

from __future__ import annotations

import random

import torch
from support.traces import ddp_record, run_check, write_traces

from ddpdoctor.analysis.checks import _coverage
from ddpdoctor.analysis.checks.data_coverage import DataCoverage
from ddpdoctor.rank.patches import coverage

LOADER = ("train.py", 20, "loader = DataLoader(ds, sampler=sampler)")
ORDER = ("train.py", 19, "sampler = DistributedSampler(ds)")
LOOP = ("train.py", 25, "for x in loader:")


def cov(indices, n, *, it=0, dist=None, smp=None, dk="d1", full=1, steps=4, sub=None, repl=None,
        rate=0) -> dict:
    """A ``cov`` record as the rank side writes it (the index set encoded by its own encoder)."""
    uniq = sorted(set(indices))
    rec = {"t": "cov", "it": it, "full": full, "nb": 3, "steps": steps, "created": LOADER, "order": ORDER,
           "site": LOOP, "smp": smp or ("DistributedSampler" if dist else "SubsetRandomSampler"),
           "kind": "map", "n": n, "dk": dk, "k": len(indices), "u": len(uniq), "fp": f"{hash(tuple(uniq)) & 0xFFFF:x}",
           "rate": rate, "ix": coverage.encode(torch.tensor(uniq, dtype=torch.int64))}
    if dist is not None:
        rec["dist"] = dist
    if sub:
        rec["sub"] = 1
    if repl:
        rec["repl"] = 1
    return rec


def dsampler(n: int, world: int, rank: int, perm: list[int], drop_last: bool = False) -> list[int]:
    """DistributedSampler's arithmetic: pad (or cut) the order to a multiple of world, take rank::world."""
    if drop_last:
        total = n - n % world
        order = perm[:total]
    else:
        total = -(-n // world) * world
        order = perm + perm[: total - n]
    return order[rank:total:world]


def test_distributed_sampler_with_padding_is_silent(tmp_path):
    perm = random.Random(0).sample(range(37), 37)
    recs = {r: [cov(dsampler(37, 2, r, perm), 37, dist=[2, r, False, 38])] for r in (0, 1)}
    assert run_check(DataCoverage, write_traces(tmp_path, recs)) == []


def test_drop_last_is_silent(tmp_path):
    perm = random.Random(1).sample(range(37), 37)
    recs = {r: [cov(dsampler(37, 2, r, perm, True), 37, dist=[2, r, True, 36])] for r in (0, 1)}
    assert run_check(DataCoverage, write_traces(tmp_path, recs)) == []


def test_shards_of_different_orders_overlap_error_with_counts(tmp_path):
    perms = {r: random.Random(10 + r).sample(range(40), 40) for r in (0, 1)}  # a per-rank shuffle
    recs = {r: [cov(dsampler(40, 2, r, perms[r]), 40, dist=[2, r, False, 40])] for r in (0, 1)}
    found = run_check(DataCoverage, write_traces(tmp_path, recs))
    assert [(f.severity, f.data["what"]) for f in found] == [("error", "overlap")]
    shards = [set(dsampler(40, 2, r, perms[r])) for r in (0, 1)]
    both = len(shards[0] & shards[1])
    assert found[0].data["shared"] == both and found[0].data["missing"] == 40 - len(shards[0] | shards[1])
    assert f"{both} sample(s) are drawn by more than one rank" in found[0].message
    assert found[0].locations[0].line == 19 and found[0].locations[0].role == "order"


def test_datasets_of_different_lengths_under_distributed_sampler(tmp_path):
    recs = {0: [cov(list(range(0, 40, 2)), 40, dist=[2, 0, False, 40])],
            1: [cov(list(range(1, 36, 2)), 36, dist=[2, 1, False, 36])]}
    found = run_check(DataCoverage, write_traces(tmp_path, recs))
    assert [(f.severity, f.data["what"]) for f in found] == [("error", "lengths")]
    assert "rank 0: 40; rank 1: 36" in found[0].message


def test_shards_that_leave_samples_out_are_a_warning(tmp_path):
    recs = {0: [cov(list(range(0, 10)), 30, dist=[2, 0, False, 30])],
            1: [cov(list(range(10, 20)), 30, dist=[2, 1, False, 30])]}
    found = run_check(DataCoverage, write_traces(tmp_path, recs))
    assert [(f.severity, f.data["what"], f.data["missing"]) for f in found] == [("warning", "missing", 10)]


def test_per_rank_sampler_lists_that_overlap_are_a_warning(tmp_path):
    recs = {0: [cov(list(range(0, 12)), 20)], 1: [cov(list(range(8, 20)), 20)]}
    found = run_check(DataCoverage, write_traces(tmp_path, recs))
    assert [(f.severity, f.data["what"], f.data["shared"]) for f in found] == [("warning", "sampler-overlap", 4)]


def test_per_rank_datasets_are_not_compared(tmp_path):
    """Different dataset identities (or none known): the same index is a different sample."""
    for i, (k0, k1) in enumerate((("a", "b"), (None, None))):
        recs = {0: [cov(list(range(12)), 12, dk=k0)], 1: [cov(list(range(12)), 12, dk=k1)]}
        assert run_check(DataCoverage, write_traces(tmp_path / str(i), recs)) == []


def test_every_rank_training_on_the_whole_dataset_is_a_warning_once(tmp_path):
    recs = {r: [ddp_record()] + [cov(random.Random(r * 7 + e).sample(range(32), 32), 32, it=e,
                                     smp="RandomSampler") for e in range(3)] for r in (0, 1)}
    found = run_check(DataCoverage, write_traces(tmp_path, recs))
    assert [(f.severity, f.data["what"], f.data["passes"], f.data["training"]) for f in found] == [
        ("warning", "whole", 3, True)]
    assert "whole dataset (32 samples)" in found[0].message


def test_every_rank_evaluating_the_whole_dataset_is_info(tmp_path):
    recs = {r: [ddp_record(), cov(list(range(32)), 32, smp="SequentialSampler", steps=0)] for r in (0, 1)}
    found = run_check(DataCoverage, write_traces(tmp_path, recs))
    assert [(f.severity, f.data["what"]) for f in found] == [("info", "whole")]


def test_uneven_but_disjoint_subsets_with_join_and_early_stop_are_silent(tmp_path):
    """Join: rank 1 has more data (disjoint Subsets of one dataset); rank 0 stops a later pass early."""
    recs = {0: [ddp_record(), cov(list(range(0, 40)), 104, smp="SequentialSampler", sub=1),
                cov(list(range(0, 13)), 104, smp="SequentialSampler", sub=1, it=1, full=0)],
            1: [ddp_record(), cov(list(range(40, 104)), 104, smp="SequentialSampler", sub=1),
                cov(list(range(40, 104)), 104, smp="SequentialSampler", sub=1, it=1)]}
    assert run_check(DataCoverage, write_traces(tmp_path, recs)) == []


def test_subgroup_peers_sharing_a_shard_are_silent(tmp_path):
    """4 ranks, 2 data-parallel replicas (ranks 0/2 and 1/3 hold the same shard by design)."""
    perm = random.Random(3).sample(range(20), 20)
    recs = {r: [cov(dsampler(20, 2, r % 2, perm), 20, dist=[2, r % 2, False, 20])] for r in range(4)}
    assert run_check(DataCoverage, write_traces(tmp_path, recs)) == []


def test_sampling_with_replacement_and_single_rank_passes_are_silent(tmp_path):
    recs = {0: [cov([1, 2, 3, 3], 10, repl=1, smp="WeightedRandomSampler")],
            1: [cov([2, 3, 4, 5], 10, repl=1, smp="WeightedRandomSampler")]}
    assert run_check(DataCoverage, write_traces(tmp_path / "a", recs)) == []
    only0 = {0: [cov(list(range(10)), 10, smp="SequentialSampler")], 1: []}  # rank-0-only evaluation
    assert run_check(DataCoverage, write_traces(tmp_path / "b", only0)) == []


def test_corrupt_index_sets_are_skipped(tmp_path):
    recs = {r: [dict(cov(list(range(r, 12)), 12), ix="I!!not base64")] for r in (0, 1)}
    assert run_check(DataCoverage, write_traces(tmp_path, recs)) == []
    assert _coverage.decode("q" + "eJw=") is None or _coverage.decode("q" + "eJw=") == []


def test_sampled_sets_agree_with_the_rank_side_hash():
    """Beyond MAX_KEEP the rank keeps hash < 2**(24-rate): the analysis' thinning keeps the same."""
    idx = torch.arange(0, 300000, dtype=torch.int64)
    h = coverage.hash_indices(idx)
    kept = idx[h < (1 << (coverage.HBITS - 3))]
    assert abs(len(kept) * 8 - 300000) < 300000 * 0.05  # an even sample of the index space
    decoded = _coverage.decode(coverage.encode(kept))
    assert decoded == kept.tolist()
    assert _coverage.at_rate(idx.tolist(), 0, 3) == set(decoded)
    assert all(_coverage.index_hash(i) == int(h[i]) for i in (0, 1, 12345, 299999))


def test_sampled_overlap_is_scaled(tmp_path):
    n = 400000
    shards = {0: torch.arange(0, 250000), 1: torch.arange(150000, n)}  # 100000 shared
    recs = {}
    for r, s in shards.items():
        kept = s[coverage.hash_indices(s) < (1 << (coverage.HBITS - 2))]
        rec = cov([0, 1], n, dist=[2, r, False, n], rate=2)
        rec.update(ix=coverage.encode(kept), u=len(s), k=len(s))
        recs[r] = [rec]
    found = run_check(DataCoverage, write_traces(tmp_path, recs))
    assert [f.data["what"] for f in found] == ["overlap"] and found[0].data["sampled"]
    assert abs(found[0].data["shared"] - 100000) < 5000 and "about" in found[0].message


def _read(path, loader_it=0):
    return {"t": "file", "op": "r", "path": path, "pos": {"0": 3}, "site": ("data.py", 12, "open(path)"),
            "dl": [LOADER, loader_it]}


def _iter_pass(it=0, full=1, steps=4):
    return {"t": "cov", "it": it, "full": full, "nb": 5, "steps": steps, "created": LOADER, "site": LOOP,
            "kind": "iter"}


def test_every_rank_reading_the_same_files_is_a_warning(tmp_path):
    files = [f"/data/shard{i}.txt" for i in range(4)]
    recs = {r: [ddp_record()] + [_read(p) for p in files] + [_iter_pass()] for r in (0, 1)}
    found = run_check(DataCoverage, write_traces(tmp_path, recs))
    assert [(f.severity, f.data["what"], f.data["files"]) for f in found] == [("warning", "same-files", 4)]
    assert found[0].locations[0].role == "read" and found[0].locations[0].line == 12


def test_overlapping_file_shards_name_the_files_nobody_read(tmp_path):
    files = [f"/data/shard{i}.txt" for i in range(4)]
    recs = {0: [_read(files[0]), _read(files[2]), _iter_pass(), _read(files[1], 1), _read(files[3], 1), _iter_pass(1)],
            1: [_read(files[0]), _read(files[1]), _iter_pass(), _read(files[0], 1), _read(files[2], 1), _iter_pass(1)]}
    found = run_check(DataCoverage, write_traces(tmp_path, recs))
    assert [(f.severity, f.data["what"]) for f in found] == [("warning", "file-overlap")]
    assert "shard0.txt" in found[0].message and found[0].data["unread"] == 1 and "shard3.txt" in found[0].message


def test_disjoint_file_shards_and_map_style_reads_are_silent(tmp_path):
    files = [f"/data/shard{i}.txt" for i in range(4)]
    recs = {r: [ddp_record(), _read(files[r]), _read(files[r + 2]), _iter_pass()] for r in (0, 1)}
    assert run_check(DataCoverage, write_traces(tmp_path / "a", recs)) == []
    # map-style: every rank reads every file of a sharded index space; the index sets decide
    m = {r: [ddp_record()] + [_read(p) for p in files] + [cov(list(range(r, 40, 2)), 40, dist=[2, r, False, 40])]
         for r in (0, 1)}
    assert run_check(DataCoverage, write_traces(tmp_path / "b", m)) == []


def test_hostile_fields_give_no_exception(tmp_path):
    bad = [{"t": "cov", "it": "x", "created": LOADER}, dict(cov([1, 2], 4), rate=10 ** 9),
           dict(cov([1, 2], 4, it=1), dist=["a", 0, False, 4]), dict(cov([1, 2], 4, it=2), n="x", steps=[1]),
           dict(cov([1, 2], 4, it=3), ix=123, kind=5), {"t": "file", "op": "r", "path": 7, "pos": {}, "dl": [LOADER, "x"]}]
    recs = {r: bad for r in (0, 1)}
    found = run_check(DataCoverage, write_traces(tmp_path, recs))
    assert all(f.id == "DD017" for f in found)


def test_a_metadata_file_every_rank_opens_beside_disjoint_shards_is_silent(tmp_path):
    recs = {r: [ddp_record(), _read("/meta/vocab.json"), _read(f"/data/shard{r}.tar"), _read(f"/data/shard{r + 2}.tar"),
                _iter_pass()] for r in (0, 1)}
    assert run_check(DataCoverage, write_traces(tmp_path, recs)) == []


def test_the_same_sampler_rank_on_several_ranks_of_the_whole_job_is_an_error(tmp_path):
    """rank=local_rank on two nodes: ranks 0/2 and 1/3 draw the same shards, half the data is never drawn."""
    perm = list(range(40))
    recs = {r: [cov(dsampler(40, 4, r % 2, perm), 40, dist=[4, r % 2, False, 40])] for r in range(4)}
    found = run_check(DataCoverage, write_traces(tmp_path, recs))
    assert [(f.severity, f.data["what"]) for f in found] == [("error", "overlap")]
    assert found[0].ranks == [0, 1, 2, 3] and "2 shard(s) are drawn by no rank" in found[0].message


def test_dataset_key_and_subset_mapping():
    from torch.utils.data import Subset, TensorDataset

    torch.manual_seed(0)
    a = TensorDataset(torch.randn(10, 3))
    torch.manual_seed(0)
    b = TensorDataset(torch.randn(10, 3))
    c = TensorDataset(torch.randn(10, 3))
    assert coverage.dataset_key(a, torch) == coverage.dataset_key(b, torch) != coverage.dataset_key(c, torch)

    class Opaque(torch.utils.data.Dataset):
        def __len__(self):
            return 5

    assert coverage.dataset_key(Opaque(), torch) is None
    base, idx = coverage._to_base(Subset(Subset(a, [9, 8, 7, 6]), [3, 0]), torch.tensor([0, 1, 5]), torch)
    assert base is a and idx.tolist() == [6, 9]  # 5 is out of range: dropped


def test_subsets_of_a_random_split_that_differs_across_ranks_are_left_to_unseeded_rng(tmp_path):
    def split(fp):
        return {"t": "split", "n": 40, "parts": [30, 10], "fp": [fp, fp + "v"], "gen": "default", "site": ("train.py", 9)}

    recs = {0: [split("a"), cov(list(range(0, 10)), 10, smp="SequentialSampler", sub=1, steps=0)],
            1: [split("b"), cov(list(range(5, 15)), 10, smp="SequentialSampler", sub=1, steps=0)]}
    assert run_check(DataCoverage, write_traces(tmp_path, recs)) == []


def test_passes_are_matched_by_epoch_and_a_peek_on_one_rank_shifts_nothing(tmp_path):
    """Rank 0 peeks at one batch (epoch 0) before training; passes match by the sampler's epoch."""
    perms = {e: random.Random(e).sample(range(40), 40) for e in range(3)}

    def ep(r, e, **kw):
        return dict(cov(dsampler(40, 2, r, perms[e]), 40, dist=[2, r, False, 40], **kw), ep=e)

    peek = dict(ep(0, 0), full=0, nb=1)
    recs = {0: [peek] + [dict(ep(0, e), it=e + 1) for e in range(3)],
            1: [dict(ep(1, e), it=e) for e in range(3)]}
    assert run_check(DataCoverage, write_traces(tmp_path / "a", recs)) == []
    # without epochs (another sampler), a peek is dropped from the pass count
    for r in recs:
        for c in recs[r]:
            c.pop("ep"), c.pop("dist")
            c["smp"] = "MySampler"
    assert run_check(DataCoverage, write_traces(tmp_path / "b", recs)) == []


def test_the_same_subset_sampler_on_every_rank_is_not_called_the_whole_dataset(tmp_path):
    recs = {r: [ddp_record(), cov(list(range(0, 30)), 40, smp="SubsetRandomSampler")] for r in (0, 1)}
    found = run_check(DataCoverage, write_traces(tmp_path, recs))
    assert [(f.severity, f.data["what"]) for f in found] == [("warning", "whole")]
    assert "the same 30 samples" in found[0].message


def _stream_pass(bfp, it=0, nbfp=4, steps=4):
    """An IterableDataset pass whose first ``nbfp`` batches fingerprint as ``bfp``."""
    return dict(_iter_pass(it, full=0, steps=steps), bfp=bfp, nbfp=nbfp)


def test_every_rank_getting_the_same_batches_while_ddp_trains_is_a_warning_once(tmp_path):
    recs = {r: [ddp_record(), _stream_pass("aa11", 0), _stream_pass("aa11", 1)] for r in (0, 1)}
    found = run_check(DataCoverage, write_traces(tmp_path, recs))
    assert [(f.severity, f.data["what"], f.data["batches"], f.data["passes"]) for f in found] == [
        ("warning", "same-batches", 4, 2)]
    assert found[0].ranks == [0, 1] and "not sharded by rank" in found[0].message
    assert [loc.role for loc in found[0].locations] == ["loader", "iteration"]


def test_streams_that_differ_evaluation_and_too_few_batches_are_silent(tmp_path):
    cases = {
        "sharded": {r: [ddp_record(), _stream_pass(f"b{r}")] for r in (0, 1)},
        "evaluation": {r: [ddp_record(), _stream_pass("cc", steps=0)] for r in (0, 1)},
        "no-ddp": {r: [_stream_pass("cc")] for r in (0, 1)},
        "one-batch": {r: [ddp_record(), _stream_pass("cc", nbfp=1)] for r in (0, 1)},
        "unfingerprinted": {r: [ddp_record(), _iter_pass()] for r in (0, 1)},
    }
    for name, recs in cases.items():
        assert run_check(DataCoverage, write_traces(tmp_path / name, recs)) == [], name


def test_tensor_parallel_peers_sharing_a_stream_are_silent(tmp_path):
    """4 ranks: TP pairs (0,1) and (2,3) read one stream per pair, DDP runs over (0,2) and (1,3)."""
    groups = [{"t": "pg", "g": "1", "ranks": [0, 2]}, {"t": "pg", "g": "2", "ranks": [1, 3]}]
    recs = {r: groups + [ddp_record(g="1" if r % 2 == 0 else "2"), _stream_pass(f"pair{r // 2}")] for r in range(4)}
    assert run_check(DataCoverage, write_traces(tmp_path, recs)) == []
    # the same layout with every rank on one stream: the DDP peers share their batches
    same = {r: groups + [ddp_record(g="1" if r % 2 == 0 else "2"), _stream_pass("one")] for r in range(4)}
    found = run_check(DataCoverage, write_traces(tmp_path / "same", same))
    assert [(f.data["what"], f.ranks) for f in found] == [("same-batches", [0, 1, 2, 3])]


def test_unsharded_files_are_reported_as_files_not_also_as_batches(tmp_path):
    files = [f"/data/shard{i}.txt" for i in range(4)]
    recs = {r: [ddp_record()] + [_read(p) for p in files] + [_stream_pass("dd")] for r in (0, 1)}
    found = run_check(DataCoverage, write_traces(tmp_path, recs))
    assert [f.data["what"] for f in found] == ["same-files"]


def test_hostile_batch_fingerprints_give_no_exception(tmp_path):
    recs = {r: [ddp_record(), dict(_stream_pass("x"), bfp=7), dict(_stream_pass("x", 1), nbfp="4"),
                dict(_stream_pass("x", 2), nbfp=True)] for r in (0, 1)}
    assert run_check(DataCoverage, write_traces(tmp_path, recs)) == []


def test_batch_fingerprints_on_the_rank_side():
    a = {"x": torch.arange(12.0).reshape(3, 4), "y": [1, "s"], "z": None}
    assert coverage.batch_fp(a, torch) == coverage.batch_fp({"x": torch.arange(12.0).reshape(3, 4), "y": [1, "s"],
                                                             "z": None}, torch)
    assert coverage.batch_fp(a, torch) != coverage.batch_fp(dict(a, x=torch.arange(12.0).reshape(3, 4) + 1), torch)
    assert coverage.batch_fp(torch.zeros(2, device="meta"), torch) is None  # not on the CPU: never read
    assert coverage.batch_fp([torch.zeros(2, device="meta"), object()], torch) is None
    assert coverage.batch_fp(object(), torch) is None
