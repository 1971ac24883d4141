"""The converter's index of each group's last digest block (frconvert._Pass.finish,
frmodel.block_offsets): the aligner reads the event it compares there with one seek. What it reads
must be what decoding the block from its start finds, and the findings must not change."""

from __future__ import annotations

import pickle

from ddpdoctor.analysis import align, frmodel
from ddpdoctor.analysis.load import BLOCK
from ddpdoctor.analysis.run import load_run

TORCH = "/opt/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py"
N = 2 * BLOCK + 90  # the last block holds 90 events


def _entry(i: int, seq: int, op: str, line: int, last: bool, group=("0", "default_pg")) -> dict:
    return {"record_id": i, "pg_id": 0, "process_group": group, "collective_seq_id": seq, "p2p_seq_id": 0,
            "profiling_name": f"nccl:{op}", "time_created_ns": 10**18 + 10**6 * i,
            "input_sizes": [[8]] if op != "barrier" else [], "input_dtypes": ["Float"] if op != "barrier" else [],
            "output_sizes": [[8]] if op != "barrier" else [], "output_dtypes": ["Float"] if op != "barrier" else [],
            "state": "started" if last else "completed", "retired": not last,
            "time_discovered_completed_ns": None if last else 10**18 + 10**6 * i + 5000, "is_p2p": False,
            "frames": [{"filename": TORCH, "line": 10, "name": op},
                       {"filename": "/home/u/train.py", "line": line, "name": "step"}]}


def _write(folder, ranks: int, bad: int, first: dict | None = None) -> None:
    """``ranks`` dumps; rank ``bad`` calls a barrier last where the others call an all_reduce.
    ``first``: rank -> first sequence id its buffer still holds (a wrapped ring buffer)."""
    for r in range(ranks):
        lo = (first or {}).get(r, 1)
        es: list[dict] = []
        for seq in range(lo, N + 1):
            last = seq == N
            op = "barrier" if last and r == bad else ("broadcast" if seq % 7 == 3 else "all_reduce")
            es.append(_entry(len(es), seq, op, 50 if op == "barrier" and last else 20 + seq % 3, last))
            if seq % 5 == 0:  # a subgroup's calls in between: the group's lines are not contiguous
                es.append(_entry(len(es), seq // 5, "all_reduce", 30, False, group=("1", "sub")))
        ranks_all = str(list(range(ranks)))
        (folder / f"nccl_trace_rank_{r}").write_bytes(pickle.dumps(
            {"version": "2.10", "pg_config": {"0": {"name": "0", "ranks": ranks_all},
                                              "1": {"name": "1", "ranks": ranks_all}},
             "entries": es}, protocol=2))


def _scan(block: align._Block, i: int) -> dict:
    """The event at ``i`` found the way a block without an index finds it."""
    plain = align._Block(block.path, block.group, block.offset, 0, like=block)
    return plain[i]


def test_the_index_points_at_the_events_the_scan_finds(tmp_path):
    _write(tmp_path, 3, bad=1)
    run = load_run([str(tmp_path)])
    b = (N - 1) // BLOCK
    first = None
    for rt in run.ranks.values():
        known = frmodel.block_offsets(rt, "0", b)
        assert known is not None and len(known) == N - b * BLOCK
        assert frmodel.block_offsets(rt, "0", b - 1) is None  # only the last block is indexed
        gs = rt.groups["0"]
        if first is None:
            first = align._Block(rt.path, "0", gs.blocks[b][2], BLOCK)
            continue
        blk = align._Block(rt.path, "0", gs.blocks[b][2], BLOCK, like=first, known=known)
        for i in range(len(blk)):
            assert blk[i] == _scan(blk, i)
            assert blk[i]["s"] == b * BLOCK + i + 1


def test_findings_are_the_same_with_and_without_the_index(tmp_path, monkeypatch):
    _write(tmp_path, 4, bad=2)
    with_index = align.first_divergence(load_run([str(tmp_path)]), "0")
    monkeypatch.setattr(frmodel, "block_offsets", lambda rt, group, b: None)
    without = align.first_divergence(load_run([str(tmp_path)]), "0")
    assert with_index is not None and with_index.seq == without.seq == N
    assert with_index.events == without.events
    assert with_index.events[2]["op"] == "barrier" and with_index.events[0]["op"] == "all_reduce"


def test_a_rewritten_file_has_no_index(tmp_path):
    # rank 0's buffer wrapped later than the others': their files are cut to the common window
    # and read again, so their blocks moved and they carry no index; the culprit stays found
    _write(tmp_path, 3, bad=1, first={0: 41})
    run = load_run([str(tmp_path)])
    n = N - 40
    b = (n - 1) // BLOCK
    assert frmodel.block_offsets(run.ranks[0], "0", b) is not None
    assert frmodel.block_offsets(run.ranks[1], "0", b) is None
    assert frmodel.block_offsets(run.ranks[2], "0", b) is None
    p = align.first_divergence(run, "0")
    assert p is not None and p.seq == N
    assert p.events[1]["op"] == "barrier" and p.events[0]["op"] == p.events[2]["op"] == "all_reduce"


def test_the_index_travels_back_from_the_worker_processes(tmp_path):
    # from PARALLEL_FROM dumps on, ranks are converted in worker processes and their summaries
    # pickled back to the report's process: the index must come with them
    _write(tmp_path, frmodel.PARALLEL_FROM, bad=3)
    run = load_run([str(tmp_path)], jobs=2)
    b = (N - 1) // BLOCK
    assert all(frmodel.block_offsets(rt, "0", b) is not None for rt in run.ranks.values())
    p = align.first_divergence(run, "0")
    assert p is not None and p.seq == N and p.events[3]["op"] == "barrier"
    assert {r for r, e in p.events.items() if e["op"] == "all_reduce"} == set(range(frmodel.PARALLEL_FROM)) - {3}
