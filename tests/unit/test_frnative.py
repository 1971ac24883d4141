"""The C reader of Flight Recorder pickles (analysis/_frpickle.c via frnative.read) against the
Python path (frdump's restricted unpickler, then frconvert reading the dicts).

What it accepts it must read as the restricted unpickler does (same values of the same types);
everything else (globals, opcodes outside the plain subset, malformed or truncated pickles...) it
must leave to the Python path (None), which alone refuses hostile files. Checked on hand-made
dumps, on converted traces byte for byte, and by fuzzing random plain data and mutated bytes."""

from __future__ import annotations

import io
import math
import os
import pickle
import random
import tempfile

import pytest

from ddpdoctor.analysis import frconvert, frdump, frnative

pytestmark = pytest.mark.skipif(not frnative.available(), reason="the C reader is not built (or DDPDOCTOR_NATIVE=0)")

TORCH = "/opt/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py"


def entry(i: int, frames, **kw) -> dict:
    e = {"record_id": i, "pg_id": 0, "process_group": ("0", "default_pg"), "collective_seq_id": i + 1,
         "p2p_seq_id": 0, "op_id": i + 1, "profiling_name": "nccl:all_reduce", "time_created_ns": 10**18 + 10**6 * i,
         "input_sizes": [[4]], "input_dtypes": ["Float"], "output_sizes": [[4]], "output_dtypes": ["Float"],
         "state": "completed", "time_discovered_completed_ns": 10**18 + 10**6 * i + 5000, "retired": True,
         "is_p2p": False, "thread_name": "python", "duration_ms": 0.005, "frames": frames}
    e.update(kw)
    return e


def dump(entries, **kw) -> dict:
    d = {"version": "2.10", "pg_config": {"0": {"name": "0", "ranks": "[0, 1]"}, "1": {"name": "1", "ranks": [1]}},
         "pg_status": {"0": {"last_completed_collective": 3}}, "entries": entries}
    d.update(kw)
    return d


def rows(data: bytes):
    from ddpdoctor.analysis import _frpickle

    return _frpickle.rows(data, frnative.FIELDS, frnative.DEFAULTS, frnative.REQUIRED)


def py_read(data: bytes):
    """What the restricted unpickler makes of the bytes; None where frdump.read gives up."""
    try:
        return frdump._PlainUnpickler(io.BytesIO(data)).load()
    except Exception:  # noqa: BLE001 - any failure: the Python path gives None or refuses
        return None


def same(a, b) -> bool:
    """Equal values of equal types, recursively (1, True and 1.0 differ; so do 0.0 and -0.0)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return len(a) == len(b) and all(same(k1, k2) and same(v1, v2)
                                        for (k1, v1), (k2, v2) in zip(a.items(), b.items()))
    if isinstance(a, float):
        return (math.isnan(a) and math.isnan(b)) or (a == b and math.copysign(1, a) == math.copysign(1, b))
    return a == b


def check(data: bytes) -> bool:
    """The C reader's answer is None or what the Python path reads; returns whether it read."""
    got = rows(data)
    if got is None:
        return False
    obj = py_read(data)
    assert isinstance(obj, dict) and isinstance(obj.get("entries"), list), (data[:80], obj)
    with tempfile.NamedTemporaryFile() as f:  # frdump.read reads a buffered file (peek), not bytes
        f.write(data)
        f.flush()
        assert same(frdump.read(f.name, "pickle"), obj)
    head, rs, kinds, stacks, pairs, ordered = got
    assert same(head, {k: v for k, v in obj.items() if k != "entries"})
    ents = [e for e in obj["entries"] if type(e) is dict]
    assert len(rs) == len(ents)
    rids = []
    for row, e in zip(rs, ents):
        assert "pg_id" in e and type(e.get("record_id")) is int
        vals = [e.get(k, d) for k, d in zip(frnative.FIELDS, frnative.DEFAULTS)]
        kidx, stidx = pairs[row[0]]
        assert same(kinds[kidx], tuple(vals[:9])), (kinds[kidx], vals[:9])
        assert same(stacks[stidx], vals[13])
        assert same(list(row[1:]), vals[9:13] + vals[14:])
        rids.append(vals[16])
    assert ordered == (rids == sorted(rids))
    return True


def converted(path: str, tmp_path, native: bool, monkeypatch) -> tuple:
    monkeypatch.setenv("DDPDOCTOR_NATIVE", "1" if native else "0")
    out = str(tmp_path / f"out-{int(native)}.jsonl")
    s = frconvert.convert((path, "pickle", out))
    rt = s.pop("trace", None)
    s.pop("out")
    if rt is not None:
        rt.path = ""
    body = open(out, "rb").read() if os.path.exists(out) else b""
    return s, rt, body


def both_paths(tmp_path, monkeypatch, obj, protocol=2, data: bytes | None = None, expect_native=True):
    """Converts the dump with the C reader and without: same summary, RankTrace and file."""
    src = tmp_path / "nccl_trace_rank_0"
    src.write_bytes(data if data is not None else pickle.dumps(obj, protocol=protocol))
    assert (rows(src.read_bytes()) is not None) == expect_native
    a = converted(str(src), tmp_path, True, monkeypatch)
    b = converted(str(src), tmp_path, False, monkeypatch)
    assert a[0] == b[0] and a[2] == b[2]
    assert a[1] == b[1]
    return a


def frames_of(*lines) -> list[dict]:
    return [{"filename": TORCH, "line": 10, "name": "all_reduce"}] + \
        [{"filename": "/home/u/train.py", "line": ln, "name": "step"} for ln in lines]


@pytest.mark.parametrize("protocol", [2, 3, 4, 5])
def test_same_trace_as_the_python_path(tmp_path, monkeypatch, protocol):
    shared = frames_of(7, 3)
    es = [entry(i, list(shared)) for i in range(6)]
    es[2] = entry(2, [dict(f) for f in shared])  # equal frames, other objects
    es[3] = entry(3, frames_of(9), input_sizes=[[4.0]], state="scheduled", retired=False)  # unfinished
    es[4] = entry(4, None, profiling_name="nccl:send 0->1", collective_seq_id=0, p2p_seq_id=1, is_p2p=True)
    es[5] = entry(5, list(shared), time_discovered_completed_ns=None)  # duration from duration_ms
    es.append("not an entry")
    s, rt, body = both_paths(tmp_path, monkeypatch, dump(es), protocol)
    assert s["entries"] == 6 and b'"t":"p"' in body and b'"pending":1' in body


def test_odd_fields_and_order(tmp_path, monkeypatch):
    es = [entry(i, frames_of(5)) for i in range(8)]
    del es[1]["state"], es[1]["profiling_name"], es[2]["frames"], es[3]["duration_ms"]
    es[4]["retired"] = 1  # an int, not a bool: another kind
    es[5]["input_sizes"] = ([4],)  # a tuple, not a list
    es[6]["pg_id"] = None
    es[6]["process_group"] = None
    es.reverse()  # record ids descending: sorted by the converter
    assert rows(pickle.dumps(dump(es), protocol=2))[5] is False
    both_paths(tmp_path, monkeypatch, dump(es))


@pytest.mark.parametrize("change", ["no pg_id", "bool record id", "str record id", "no record id",
                                    "cycle", "huge int", "bytearray", "set", "no entries"])
def test_left_to_the_python_path(tmp_path, monkeypatch, change):
    es = [entry(i, frames_of(5)) for i in range(3)]
    d = dump(es)
    if change == "no pg_id":
        del es[1]["pg_id"]
    elif change == "bool record id":
        es[1]["record_id"] = True
    elif change == "str record id":
        es[1]["record_id"] = "1"
    elif change == "no record id":
        del es[1]["record_id"]
    elif change == "cycle":
        loop: list = []
        loop.append(loop)
        d["pg_status"] = loop
    elif change == "huge int":
        es[1]["time_created_ns"] = 2**70
    elif change == "bytearray":
        d["x"] = bytearray(b"ab")
    elif change == "set":
        d["x"] = {1, 2}
    else:
        del d["entries"]
    both_paths(tmp_path, monkeypatch, d, expect_native=False)


def test_repeated_keys_last_wins(tmp_path, monkeypatch):
    e = entry(0, frames_of(5), record_iX=9, state="scheduled", statX="completed")
    data = pickle.dumps(dump([e], entrieX=[entry(1, None)]), protocol=2)
    data = data.replace(b"record_iX", b"record_id").replace(b"statX", b"state").replace(b"entrieX", b"entries")
    obj = py_read(data)
    assert obj["entries"][0]["record_id"] == 1 and check(data)
    both_paths(tmp_path, monkeypatch, None, data=data)


def test_hostile_pickle_is_left_to_the_refusing_reader(tmp_path, monkeypatch):
    class Hostile:
        def __reduce__(self):
            return (os.system, ("true",))

    data = pickle.dumps(dump([entry(0, None, state=Hostile())]), protocol=2)
    assert rows(data) is None
    src = tmp_path / "fr_trace_rank_3"
    src.write_bytes(data)
    s = frconvert.convert((str(src), "pickle", str(tmp_path / "o.jsonl")))
    assert "refusing" in s["refused"]


def test_off_switch(tmp_path, monkeypatch):
    src = tmp_path / "d0"
    src.write_bytes(pickle.dumps(dump([entry(0, None)]), protocol=2))
    assert frnative.read(str(src)) is not None
    monkeypatch.setattr(frnative, "MAX_BYTES", 100)  # large files: the Python path
    assert frnative.read(str(src)) is None
    monkeypatch.undo()
    monkeypatch.setenv("DDPDOCTOR_NATIVE", "0")
    assert frnative.read(str(src)) is None and not frnative.available()


def _value(rng: random.Random, depth: int, pool: list):
    k = rng.randrange(14 if depth < 4 else 9)
    if k == 0:
        return rng.choice([None, True, False])
    if k == 1:
        return rng.choice([0, 1, -1, 255, 256, 65535, 65536, -2**31, 2**31, 2**63 - 1, -2**63, 2**64, 2**70,
                           rng.randrange(-10**19, 10**19)])
    if k == 2:
        return rng.choice([0.0, -0.0, 1.5, 1.0, float("inf"), float("nan"), rng.random()])
    if k in (3, 4):
        return rng.choice(["", "a", "state", "completed", "é", "\ud800", "record_id", "x" * 300])
    if k == 5:
        return rng.choice([b"", b"ab", b"\xff" * 300])
    if k in (6, 7, 8):
        return rng.choice(pool) if pool else None  # shared objects (the memo)
    n = rng.randrange(4)
    if k in (9, 10):
        v = [_value(rng, depth + 1, pool) for _ in range(n)]
    elif k == 11:
        v = tuple(_value(rng, depth + 1, pool) for _ in range(n))
    else:
        keys = ["pg_id", "record_id", "frames", "state", 1, (1, "a"), None, 2.5]
        v = {rng.choice(keys): _value(rng, depth + 1, pool) for _ in range(n)}
    pool.append(v)
    return v


def _dumplike(rng: random.Random):
    pool: list = []
    es = []
    for _i in range(rng.randrange(6)):
        e = entry(rng.randrange(5), frames_of(rng.randrange(3)) if rng.random() < 0.5 else rng.choice(pool or [None]))
        for _ in range(rng.randrange(4)):
            e[rng.choice(frnative.FIELDS + ("other",))] = _value(rng, 1, pool)
        if rng.random() < 0.2:
            e.pop(rng.choice(frnative.FIELDS), None)
        es.append(e)
        pool.append(e)
    if rng.random() < 0.2:
        es.append(_value(rng, 1, pool))
    return dump(es, extra=_value(rng, 1, pool))


def test_fuzz_against_the_python_path():
    rng = random.Random(14)
    read = valid = 0
    for _it in range(1500):
        data = pickle.dumps(_dumplike(rng), protocol=rng.choice([2, 3, 4, 5]))
        valid += 1
        read += check(data)
        for _ in range(3):  # mutated bytes: truncated, a byte changed, a byte inserted
            b = bytearray(data)
            at = rng.randrange(len(b))
            how = rng.randrange(3)
            if how == 0:
                del b[at:]
            elif how == 1:
                b[at] = rng.randrange(256)
            else:
                b.insert(at, rng.randrange(256))
            check(bytes(b))
    assert read > valid // 3, (read, valid)  # most plain dumps are read in C


def test_random_bytes_are_never_read():
    rng = random.Random(7)
    for _ in range(3000):
        data = b"\x80\x02" + bytes(rng.randrange(256) for _ in range(rng.randrange(1, 40)))
        check(data)


def test_frames_shorter_or_longer_than_their_opcodes():
    """The unpickler reads a FRAME into a buffer and an opcode running past its end from the file
    again (skipping the frame's rest): such pickles are not plain reads and are left to it."""
    data = pickle.dumps(dump([entry(i, frames_of(5)) for i in range(3)]), protocol=4)
    assert data[2] == 0x95  # FRAME, its length in the next 8 bytes
    length = int.from_bytes(data[3:11], "little")
    assert check(data)
    for delta in list(range(-60, 0)) + [1, 2, 7]:
        check(data[:3] + (length + delta).to_bytes(8, "little") + data[11:])


def test_fields_are_the_converters():
    """The C reader's rows follow frconvert's field order: its first 13 fields, then frames."""
    assert frnative.FIELDS[:13] == frconvert._NAMES and frnative.FIELDS[13] == "frames"
    assert frnative.ROW == frnative.FIELDS[9:13] + frnative.FIELDS[14:]


def test_benchmark_dumps_same_both_ways(tmp_path, monkeypatch):
    """bench/fr_scale.py's torch-shaped dumps (shared frame dicts, a wrapped buffer, the bug)."""
    from bench import fr_scale

    folder = tmp_path / "dumps"
    folder.mkdir()
    fr_scale.write(str(folder), 2, entries=300)
    for src in sorted(folder.iterdir()):
        data = src.read_bytes()
        assert check(data)
        s, _rt, body = both_paths(tmp_path, monkeypatch, None, data=data)
        assert s["entries"] == 300 and body.count(b'"t":"c"') == 300
