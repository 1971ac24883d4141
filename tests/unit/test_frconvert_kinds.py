"""The Flight Recorder converter's caches (frconvert._Pass): entries of one kind (fields and stack)
are worked out once, stacks are recognised by comparison. A cache must never merge entries whose
lines differ, and what the converter computes must stay what load.read_rank makes of the file."""

from __future__ import annotations

import json
import pickle

from ddpdoctor.analysis import frconvert, load

TORCH = "/opt/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py"


def frame(filename, line, name="f") -> dict:
    return {"filename": filename, "line": line, "name": name}


def entry(i: int, frames, sizes=((4,),), dtypes=("Float",), **kw) -> dict:
    e = {"record_id": i, "pg_id": 0, "process_group": ("0", "default_pg"), "collective_seq_id": i + 1,
         "p2p_seq_id": 0, "op_id": i + 1, "profiling_name": "nccl:all_reduce",
         "time_created_ns": 10**18 + 10**6 * i, "input_sizes": [list(s) for s in sizes],
         "input_dtypes": list(dtypes), "output_sizes": [list(s) for s in sizes], "output_dtypes": list(dtypes),
         "state": "completed", "time_discovered_completed_ns": 10**18 + 10**6 * i + 5000, "retired": True,
         "is_p2p": False, "frames": frames}
    e.update(kw)
    return e


def convert(tmp_path, entries, protocol=2) -> tuple[list[dict], dict, dict]:
    """(events, sites by id, summary); checks the RankTrace against load.read_rank."""
    src = tmp_path / "nccl_trace_rank_0"
    src.write_bytes(pickle.dumps({"version": "2.10", "pg_config": {"0": {"name": "0", "ranks": "[0, 1]"}},
                                  "entries": entries}, protocol=protocol))
    out = tmp_path / "rank0.jsonl"
    s = frconvert.convert((str(src), "pickle", str(out)))
    direct, read = s["trace"], load.read_rank(str(out))
    direct.tail = read.tail  # the converter keeps a shorter tail, by design
    assert read.problems == [] and direct == read
    recs = [json.loads(x) for x in out.read_text().splitlines()]
    sites = {r["id"]: r for r in recs if r["t"] == "site"}
    return [r for r in recs if r["t"] in ("c", "p")], sites, s


def test_entries_with_equal_stacks_share_their_site(tmp_path):
    shared = [frame(TORCH, 10, "all_reduce"), frame("/home/u/train.py", 7, "step"), frame("/home/u/train.py", 3)]
    copies = [dict(f) for f in shared]  # equal frames, other objects (a pickle without the memo)
    other = [frame(TORCH, 10, "all_reduce"), frame("/home/u/train.py", 9, "step"), frame("/home/u/train.py", 3)]
    events, sites, _s = convert(tmp_path, [entry(0, list(shared)), entry(1, list(shared)), entry(2, copies),
                                           entry(3, other), entry(4, list(shared))])
    ids = [e["site"] for e in events]
    assert ids[0] == ids[1] == ids[2] == ids[4] != ids[3]
    assert sites[ids[0]]["line"] == 7 and sites[ids[3]]["line"] == 9
    # entries of one kind differ only in their position and times
    assert [e["s"] for e in events] == [1, 2, 3, 4, 5] and len({e["ts"] for e in events}) == 5


def test_all_distinct_stacks(tmp_path):
    entries = [entry(i, [frame(TORCH, 10, "all_reduce"), frame(f"/home/u/m{i}.py", i + 1, "step")])
               for i in range(40)]
    events, sites, _s = convert(tmp_path, entries)
    assert len({e["site"] for e in events}) == 40 == len(sites)
    assert [(sites[e["site"]]["file"], sites[e["site"]]["line"]) for e in events] == \
        [(f"/home/u/m{i}.py", i + 1) for i in range(40)]


def test_equal_but_differently_typed_values_are_not_merged(tmp_path):
    """1 == True == 1.0 and [1] != (1,) in Python; what a line shows tells them apart, so must
    the caches: each entry converts as it would alone."""
    same = [frame(TORCH, 10, "all_reduce"), frame("/home/u/a.py", 5, "step")]
    entries = [entry(0, same, sizes=((1,),)), entry(1, same, sizes=((True,),)), entry(2, same, sizes=((1.0,),)),
               entry(3, same, dtypes=("Half",)), entry(4, same, sizes=((1,),)),
               entry(5, [frame(1, 5)]), entry(6, [frame(True, 5)]),  # equal frames, other file names
               entry(7, same, state=1, retired=False), entry(8, same, state=True, retired=False)]
    events, sites, s = convert(tmp_path, entries)
    assert [e["x"] for e in events[:5]] == [["float32[1]"], ["float32[True]"], ["float32[1.0]"],
                                             ["float16[4]"], ["float32[1]"]]
    assert sites[events[5]["site"]]["stack"][0][0] == "1" and sites[events[6]["site"]]["stack"][0][0] == "True"
    assert [e["fr"] for e in events[7:]] == ["1", "True"] and all(e["pending"] == 1 for e in events[7:])
    assert s["trace"].header["fr"]["incomplete"] == 2


def test_bytes_and_bytearray_are_not_merged(tmp_path):
    same = [frame(TORCH, 10, "all_reduce")]
    events, _sites, _s = convert(tmp_path, [entry(0, same, dtypes=(b"F",)), entry(1, same, dtypes=(bytearray(b"F"),))],
                                 protocol=5)
    assert [e["x"] for e in events] == [["b'f'[4]"], ["bytearray(b'f')[4]"]]


def test_group_from_pg_id_when_the_entry_names_no_process_group(tmp_path):
    same = [frame(TORCH, 10, "all_reduce")]
    a, b = entry(0, same, pg_id=3), entry(1, same, pg_id=4, collective_seq_id=1)
    del a["process_group"], b["process_group"]
    events, _sites, s = convert(tmp_path, [a, b])
    assert [(e["g"], e["s"]) for e in events] == [("3", 1), ("4", 1)]
    assert s["groups"] == {"3": [1, 1, 1], "4": [1, 1, 1]}


def test_counters_and_digests_summed_per_kind_match_the_file(tmp_path):
    """Interleaved groups, a barrier followed by different ops, gaps and more than one digest block:
    the RankTrace summed per kind at the end equals load.read_rank's (checked in convert)."""
    stacks = {k: [frame(TORCH, 10 + k, "op"), frame("/home/u/t.py", 20 + k, "step")] for k in range(3)}
    entries, seq = [], {"0": 0, "7": 0}
    for i in range(700):
        g = "7" if i % 3 == 0 else "0"
        seq[g] += 2 if i in (100, 400) else 1
        pn = "nccl:barrier" if i % 50 == 0 else ("nccl:allgather" if i % 7 == 0 else "nccl:all_reduce")
        entries.append(entry(i, stacks[i % 3], process_group=(g, "x"), collective_seq_id=seq[g],
                             profiling_name=pn, sizes=((i % 5 + 1,),)))
    events, _sites, s = convert(tmp_path, entries)
    assert len(events) == 700 and s["trace"].groups["0"].count > load.BLOCK
    assert any("then" in n for n in s["notes"])
    assert s["trace"].after_barrier and s["trace"].op_sites


def test_keys_of_shared_cyclic_and_large_values(tmp_path):
    """The kind key (frdump.KeyPickler, fast mode: no memo) of a value shared twice inside an
    entry equals its copy's; a cyclic value falls back to the memo's pickle; a value larger than
    a pickle frame is written in parts, joined. Each entry converts as it would alone."""
    same = [frame(TORCH, 10, "all_reduce")]
    shape = [4]
    cyc: list = [2]
    cyc.append(cyc)
    big = "x" * 200_000
    entries = [entry(0, same), entry(1, same, input_sizes=[shape], output_sizes=[shape]),  # shared
               entry(2, same, input_sizes=[cyc]), entry(3, same, input_sizes=[cyc]),
               entry(4, same, input_dtypes=[big]), entry(5, same, input_dtypes=[big + "y"]), entry(6, same)]
    events, _sites, _s = convert(tmp_path, entries, protocol=4)
    xs = [e["x"] for e in events]
    assert xs[0] == xs[1] == xs[6] == ["float32[4]"]
    assert xs[2] == xs[3] == ["float32[2,[2, [...]]]"]
    assert xs[4] == [f"{big.lower()}[4]"] and xs[5] == [f"{big.lower()}y[4]"]


def test_key_pickler_tells_values_apart_exactly():
    from ddpdoctor.analysis import frdump

    kp = frdump.KeyPickler()
    values = [1, True, 1.0, [1], (1,), "1", b"1", bytearray(b"1"), {"a": 1}, {"a": True}, [[1, 2]], [[1], [2]]]
    keys = []
    for v in values:
        kp.pickler.dump(v)
        keys.append(b"".join(kp.parts))
        kp.parts.clear()
    assert len(set(keys)) == len(values)
    kp.pickler.dump(([1], [1]))  # one list twice or two equal lists: one key
    shared = [1]
    kp.pickler.dump((shared, shared))
    assert kp.parts.pop() == kp.parts.pop() and not kp.parts
