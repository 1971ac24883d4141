"""Data coverage: which samples each rank's DataLoader drew in each pass (the data-coverage check).

One ``cov`` record per pass over a DataLoader (an epoch), written when the pass ends (the
sampler is exhausted), when the same iterator is reset for the next pass, or at exit for a pass
left early. The cost is per batch and per pass, never a Python call per sample: the iterator of
the loader's index sampler is wrapped once per pass, each batch of indices is appended to an
``array`` (one C call), and at the end of the pass the indices are mapped through ``Subset``
chains to the base dataset, deduplicated, hashed and encoded in bulk with torch.

The record keeps the distinct indices exactly up to ``MAX_KEEP`` per pass; beyond that, the
indices whose multiplicative hash falls under a power-of-two threshold (the same subset of the
index space on every rank, so overlaps and gaps are counted exactly within it and scaled). After
``BUDGET`` bytes of index sets per rank, passes carry only counts and a set digest.

The first batches of an IterableDataset pass are fingerprinted (``bfp``): such a pass has no
indices, and ranks that got equal batches were not sharded.

While a DataLoader iterator produces a batch, ``rec.local.dl`` names the pass, so that the file
audit hook (files.py) marks the files read for it (file-level coverage, e.g. IterableDatasets
that shard a list of files by hand).
"""

from __future__ import annotations

import base64
import functools
import os
import weakref
import zlib
from array import array

from .. import recorder as recorder_mod
from . import WRAPPED
from .stephooks import STEPS as _STEPS

#: Distinct indices kept exactly per pass; above, a hash-threshold sample of about this many.
MAX_KEEP = 1 << 16
#: Bytes of encoded index sets per rank; later passes carry counts and the digest only.
BUDGET = 16 << 20
#: Batches of an IterableDataset pass whose contents are fingerprinted (the first ones).
FP_BATCHES = 4
#: Bits of the index hash; with ``rate`` r, an index is kept when its hash < 2**(HBITS - r).
HBITS = 24
_KNUTH = 2654435761
#: ``DDPDOCTOR_COVERAGE=0`` turns the recording of DataLoader passes off.
ENABLED = os.environ.get("DDPDOCTOR_COVERAGE", "1") != "0"

_state: dict = {"iters": {}, "open": weakref.WeakValueDictionary(), "closed": [], "budget": BUDGET,
                "installed": False, "exit": False}
_made: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # sampler/Subset/loader -> site id
_subset_ix: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # Subset -> its indices as a tensor


def _rec():
    rec = recorder_mod.get()
    if rec is None or rec.writer is None or not rec.enabled:
        return None
    return rec


def hash_indices(idx):
    """The 24-bit hash of each index (int64 tensor): the sample kept beyond MAX_KEEP is
    ``hash < 2**(HBITS - rate)``, the same indices on every rank."""
    return ((idx * _KNUTH) & 0xFFFFFFFF) >> (32 - HBITS)


def encode(sorted_idx) -> str:
    """Sorted distinct indices -> delta-encoded, zlib-compressed, base64 text."""
    import torch

    d = torch.diff(sorted_idx, prepend=sorted_idx.new_zeros(1)) if sorted_idx.numel() else sorted_idx
    deltas = d.tolist()
    code = "I" if max(deltas, default=0) < 1 << 32 else "q"  # deltas of sorted non-negative values
    return code + base64.b64encode(zlib.compress(array(code, deltas).tobytes(), 6)).decode()


class _Tap:
    """The iterator of a loader's index sampler for one pass, collecting what it yields."""

    __slots__ = ("inner", "buf", "opaque", "info", "nb", "it", "done", "steps0", "fps", "__weakref__")

    def __init__(self, inner, info: dict, opaque: bool) -> None:
        self.inner = inner
        self.buf = array("q")
        self.opaque = opaque
        self.info = info
        self.nb = 0
        self.it = None  # pass number, assigned at the first draw
        self.done = False
        self.steps0 = 0
        # fingerprints of the first batches of an IterableDataset pass (no indices to compare);
        # None once a batch could not be fingerprinted
        self.fps: list[str] | None = [] if opaque else None

    def __iter__(self):
        return self

    def __getattr__(self, name: str):
        # anything else the loader's code asks of its sampler iterator (a stateful loader's
        # state_dict...) is the wrapped iterator's
        if name in _Tap.__slots__:
            raise AttributeError(name)
        return getattr(self.inner, name)

    def __next__(self):
        if self.it is None:
            self._start()
        try:
            b = next(self.inner)
        except StopIteration:
            self.finish(True)
            raise
        self.nb += 1
        if not self.opaque:
            try:
                if isinstance(b, (list, tuple)):
                    self.buf.extend(b)
                else:
                    self.buf.append(b)
            except (TypeError, OverflowError, ValueError):
                self.opaque = True  # keys that are not integers: counts only
                self.buf = array("q")
        return b

    def _start(self) -> None:
        key = self.info.get("created")
        self.it = _state["iters"].get(key, 0)
        _state["iters"][key] = self.it + 1
        self.steps0 = _STEPS[0]
        _state["open"][id(self)] = self

    def finish(self, full: bool) -> None:
        if self.done or self.it is None:
            return
        self.done = True
        _state["open"].pop(id(self), None)
        rec = _rec()
        if rec is None:
            return
        try:
            rec.emit(_record(self, full))
        except Exception as exc:
            rec.internal_error(exc)
        self.buf = array("q")
        self.info = {}


def _abandoned(tap: _Tap) -> None:
    """The iterator of an unfinished pass was collected: written at the next pass or at exit
    (never from inside the garbage collector, which may run in the middle of a record)."""
    if not tap.done and tap.it is not None:
        _state["closed"].append(tap)


def _flush() -> None:
    while _state["closed"]:
        _state["closed"].pop().finish(False)


def _subset_indices(sub, torch):
    t = _subset_ix.get(sub)
    if t is None:
        ind = sub.indices
        t = ind.to(torch.int64).reshape(-1) if torch.is_tensor(ind) else torch.as_tensor(list(ind), dtype=torch.int64)
        try:
            _subset_ix[sub] = t
        except TypeError:
            pass
    return t


def _to_base(ds, idx, torch):
    """Indices into ``ds`` mapped through its Subset chain; (base dataset, indices)."""
    from torch.utils.data import Subset

    for _ in range(16):
        if not isinstance(ds, Subset):
            break
        ix = _subset_indices(ds, torch)
        idx = idx[(idx >= -len(ix)) & (idx < len(ix))]
        idx = ix[idx]
        ds = ds.dataset
    return ds, idx


def _tensor_fp(t, torch) -> str:
    if t.device.type != "cpu":  # a copy from an accelerator would synchronise it
        return f"{t.dtype}{list(t.shape)}"
    flat = t.detach().reshape(-1)
    step = max(1, flat.numel() // 64)
    sample = flat[::step][:64]
    if sample.dtype.is_floating_point or sample.dtype.is_complex:
        sample = sample.float() if not sample.dtype.is_complex else torch.view_as_real(sample).float()
    return f"{t.dtype}{list(t.shape)}:{zlib.crc32(repr(sample.tolist()).encode()):08x}"


def batch_fp(batch, torch, depth: int = 0) -> str | None:
    """A fingerprint of what a batch holds: CPU tensors by a strided sample of their values,
    numbers and strings by value, containers item by item (at most 16). None when nothing in it
    is evidence (tensors on an accelerator: reading them would synchronise it)."""
    if torch.is_tensor(batch):
        return _tensor_fp(batch, torch) if batch.device.type == "cpu" else None
    if _simple(batch):
        return repr(batch)[:200]
    if depth >= 3:
        return None
    if isinstance(batch, dict):
        items = [(str(k), batch[k]) for k in list(batch)[:16]]
    elif isinstance(batch, (list, tuple)):
        items = [(str(i), v) for i, v in enumerate(batch[:16])]
    else:
        return None
    parts = [(k, batch_fp(v, torch, depth + 1)) for k, v in items]
    if all(fp is None for _, fp in parts):
        return None
    return "{" + ",".join(f"{k}:{fp}" for k, fp in parts) + "}"


def _with_batch(fps: list[str], batch) -> list[str] | None:
    try:
        import torch

        fp = batch_fp(batch, torch)
    except Exception:  # a batch of an unexpected kind: no fingerprints for this pass
        return None
    if fp is None:
        return None
    fps.append(fp)
    return fps


def _simple(v) -> bool:
    return v is None or isinstance(v, (str, int, float, bool, bytes))


def dataset_key(ds, torch) -> str | None:
    """What identifies the data behind the indices, from the dataset's own attributes (never by
    calling its code): tensors by a strided sample, lists by length and a sample of simple
    items, scalars by value. None when there is no such evidence (indices of two ranks' datasets
    then cannot be compared)."""
    parts = [type(ds).__module__ + "." + type(ds).__qualname__]
    evidence = 0
    try:
        attrs = dict(vars(ds))
    except TypeError:
        return None
    for name in sorted(attrs)[:48]:
        v = attrs[name]
        try:
            if torch.is_tensor(v):
                parts.append(f"{name}={_tensor_fp(v, torch)}")
            elif isinstance(v, (list, tuple)) and name != "tensors":
                step = max(1, len(v) // 16)
                items = [x if _simple(x) else (list(x) if isinstance(x, tuple) and all(map(_simple, x)) else type(x).__name__)
                         for x in v[::step][:16]]
                parts.append(f"{name}:{len(v)}:{zlib.crc32(repr(items).encode()):08x}")
            elif name == "tensors" and isinstance(v, (list, tuple)):
                parts.extend(f"t{i}={_tensor_fp(x, torch)}" for i, x in enumerate(v) if torch.is_tensor(x))
            elif type(v).__name__ == "ndarray":
                flat = v.reshape(-1)
                parts.append(f"{name}={v.dtype}{list(v.shape)}:{zlib.crc32(flat[::max(1, flat.size // 64)][:64].tobytes()):08x}")
            elif _simple(v):
                parts.append(f"{name}={v!r}"[:200])
            else:
                continue
            evidence += 1
        except Exception:
            continue
    return format(zlib.crc32("|".join(parts).encode()), "08x") if evidence else None


def _distinct(idx, torch):
    """Sorted distinct values of non-negative indices: a mark per value when they are dense (a
    linear pass; sorting half a million indices costs ten times more), else a sort."""
    if not idx.numel():
        return idx
    top = int(idx.max()) + 1
    if top > 64 * idx.numel() + 4096:
        return torch.unique(idx)
    seen = torch.zeros(top, dtype=torch.bool)
    seen[idx] = True
    return seen.nonzero().reshape(-1)


def _record(tap: _Tap, full: bool) -> dict:
    import torch

    info = tap.info
    rec = {"t": "cov", "it": tap.it, "full": int(full), "nb": tap.nb, "steps": _STEPS[0] - tap.steps0}
    for k in ("created", "order", "site", "smp", "dist", "repl", "kind", "sub", "ep"):
        if info.get(k) is not None:
            rec[k] = info[k]
    if tap.opaque:
        if tap.fps:
            # what the first batches held: equal across ranks = every rank got the same data
            rec["bfp"] = format(zlib.crc32("|".join(tap.fps).encode()), "08x")
            rec["nbfp"] = len(tap.fps)
        return rec
    idx = torch.frombuffer(tap.buf, dtype=torch.int64) if len(tap.buf) else torch.zeros(0, dtype=torch.int64)
    try:
        rec["n"] = len(info["ds"])  # the loader's dataset: what its sampler shards
    except Exception:
        pass
    try:
        base, idx = _to_base(info["ds"], idx, torch)
    except (TypeError, ValueError, IndexError, RuntimeError):
        return rec  # Subset indices of an unexpected kind: counts only
    rec["dk"] = dataset_key(base, torch)
    uniq = _distinct(idx[idx >= 0], torch)
    rec["k"] = int(idx.numel())
    rec["u"] = int(uniq.numel())
    h = hash_indices(uniq)
    rec["fp"] = f"{int(h.sum()) & 0xFFFFFFFFFFFF:012x}"
    rate = 0
    while (uniq.numel() >> rate) > MAX_KEEP and rate < HBITS - 1:
        rate += 1
    kept = uniq[h < (1 << (HBITS - rate))] if rate else uniq
    text = encode(kept)
    if len(text) <= _state["budget"]:
        _state["budget"] -= len(text)
        rec["rate"] = rate
        rec["ix"] = text
    return rec


def _at_exit() -> None:
    _flush()
    for tap in sorted(_state["open"].values(), key=lambda t: t.it or 0):
        tap.finish(False)


def _site_of(obj):
    """Where ``obj`` was constructed (site id), or None (not seen, or an unhashable object)."""
    try:
        return _made.get(obj)
    except TypeError:
        return None


def _info(loader, rec) -> dict:
    from torch.utils.data import IterableDataset, Subset
    from torch.utils.data.distributed import DistributedSampler

    smp = getattr(loader, "sampler", None)
    bs = getattr(loader, "batch_sampler", None)
    info: dict = {"ds": loader.dataset, "created": _site_of(loader), "site": rec.sites.current(2)}
    if isinstance(loader.dataset, IterableDataset):
        info["kind"] = "iter"
        return info
    info["kind"] = "map"
    if isinstance(loader.dataset, Subset):
        info["sub"] = 1  # indices are mapped to the base dataset's
    inner = getattr(bs, "sampler", None) if bs is not None else None
    order = smp if inner is None or inner is smp else inner  # a user batch_sampler's own sampler
    user_bs = bs is not None and inner is None
    if user_bs:
        order = bs
    info["smp"] = type(order).__name__
    site = getattr(order, "_ddpdoctor_site", None)
    if site is None:
        site = _site_of(order)
    if site is None:
        site = _site_of(loader.dataset)
    info["order"] = site if site is not None else info["created"]
    if isinstance(order, DistributedSampler):
        info["dist"] = [int(order.num_replicas), int(order.rank), bool(order.drop_last),
                        int(getattr(order, "total_size", 0))]
    if getattr(order, "replacement", False):
        info["repl"] = 1
    ep = getattr(order, "epoch", None)
    if isinstance(ep, int) and not isinstance(ep, bool):
        info["ep"] = ep  # set_epoch's value: passes are matched across ranks by it
    return info


def _tap(it, loader, old=None) -> None:
    """Replace the iterator's sampler iterator with a tap; ``old``: the previous pass's tap."""
    rec = _rec()
    if rec is None:
        return
    try:
        if isinstance(old, _Tap):
            old.finish(False)  # a persistent iterator reset before its pass ended
        _flush()
        if getattr(it, "_sampler_iter", None) is None:
            return
        if not _state["exit"]:
            import atexit

            _state["exit"] = True
            atexit.register(_at_exit)  # registered after the rank's exit hooks: runs before them
        info = _info(loader, rec)
        tap = _Tap(it._sampler_iter, info, opaque=info["kind"] != "map")
        it._sampler_iter = tap
        it._ddpdoctor_info = info
        weakref.finalize(it, _abandoned, tap).atexit = False
    except Exception as exc:
        rec.internal_error(exc)


def _wrap(owner, name: str, make) -> None:
    orig = owner.__dict__.get(name)
    if orig is None or getattr(orig, WRAPPED, False):
        return
    new = functools.wraps(orig)(make(orig))
    setattr(new, WRAPPED, True)
    setattr(owner, name, new)


def _remember_site(orig):
    def __init__(self, *args, **kwargs):
        rec = recorder_mod.get()  # before init_process_group too: sites are kept until the file opens
        sid = None
        if rec is not None and rec.enabled:
            try:
                # interned before the objects the constructor makes (a DataLoader's samplers),
                # whose sites are the same line seen through torch
                sid = rec.sites.current(2)
            except Exception:
                sid = None
        orig(self, *args, **kwargs)
        if sid is not None:
            try:
                _made[self] = sid
            except TypeError:
                pass
    return __init__


def patch() -> None:
    """Wrap the DataLoader iterator and the samplers' constructors, once per process."""
    if _state["installed"] or not ENABLED:
        return
    _state["installed"] = True
    import torch.utils.data as tud
    from torch.utils.data import dataloader as dl_mod

    for cls in (tud.DataLoader, tud.RandomSampler, tud.SequentialSampler, tud.SubsetRandomSampler,
                tud.WeightedRandomSampler, tud.BatchSampler, tud.Subset):
        _wrap(cls, "__init__", _remember_site)
    base = dl_mod._BaseDataLoaderIter

    def make_init(orig):
        def __init__(self, loader, *args, **kwargs):
            orig(self, loader, *args, **kwargs)
            _tap(self, loader)
        return __init__

    def make_reset(orig):
        def _reset(self, loader, *args, **kwargs):
            old = getattr(self, "_sampler_iter", None)
            orig(self, loader, *args, **kwargs)
            _tap(self, loader, old)
        return _reset

    def make_next(orig):
        def __next__(self):
            info = getattr(self, "_ddpdoctor_info", None)
            r = recorder_mod.get()
            if info is None or r is None or r.writer is None:
                return orig(self)
            tap = self._sampler_iter
            prev = getattr(r.local, "dl", None)
            # the pass being drawn, for file records made while this batch is loaded
            r.local.dl = [info.get("created"), tap.it if isinstance(tap, _Tap) and tap.it is not None
                          else _state["iters"].get(info.get("created"), 0)]
            try:
                batch = orig(self)
            finally:
                r.local.dl = prev
            if isinstance(tap, _Tap) and tap.fps is not None and len(tap.fps) < FP_BATCHES:
                tap.fps = _with_batch(tap.fps, batch)
            return batch
        return __next__

    _wrap(base, "__init__", make_init)
    _wrap(base, "_reset", make_reset)
    _wrap(base, "__next__", make_next)
    # optimizer steps are counted by each optimizer's post hook (stephooks.STEPS), shared with
    # the replica digests: one Python call per step instead of one per feature
