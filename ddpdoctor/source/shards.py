"""Per-rank data: values each rank computes from its own shard of the data.

A ``DistributedSampler`` (or a loader prepared by ``accelerator.prepare``) gives every rank a
different part of the dataset, so what a rank computes from its batches (a loss, a validation
metric, a count of NaN batches) differs from rank to rank, although nothing in it names the rank.
A condition on such a value (``if val_loss < best:``, ``if bad >= patience: break``) is met on
some ranks and not on others: the early-stopping hang. These values are tainted like the rank,
and cleared the same way (an all-reduce, a broadcast, ``accelerator.gather``).

Two kinds of reasons carry it through :mod:`taint`'s sets of reasons:

- ``#...`` marks a *sharded source* (the sampler, the loader). The source itself is the same
  size on every rank (``DistributedSampler`` pads), so a loop over it, ``len(loader)`` or
  ``if loader is None`` are not rank-dependent: ``#`` reasons never reach a condition
  (:func:`strip_sources`). They flow through plain assignments, parameters, returns and the
  wrappers that hand on their argument's items (``enumerate``, ``tqdm``, ``iter``, ``zip``).
- iterating a sharded source turns ``#X`` into ``%X`` (:func:`items`): its *items* are this
  rank's data, and ``%`` reasons taint like the rank. A function's parameter iterated inside
  it is ``@N*`` ("the items of parameter N") until a caller's argument is substituted.

The shape of a batch (``len(batch)``, ``x.shape``, ``x.size(0)``) is not data: with a
``DistributedSampler`` every rank gets the same number of batches of the same sizes.
"""

from __future__ import annotations

SOURCE = "#"
DATA = "%"
#: Attributes and methods of a batch that are the same on every rank of a padded sampler.
SHAPE_ATTRS = frozenset({"shape", "ndim", "dtype", "device", "is_cuda", "layout"})
SHAPE_METHODS = frozenset({"size", "dim", "numel", "nelement", "ndimension", "get_device", "element_size"})
#: Calls whose result iterates over their arguments' items (the items stay this rank's data).
ITEM_PASSING = frozenset({"enumerate", "tqdm", "trange", "track", "iter", "zip", "chain", "islice",
                          "MpDeviceLoader", "ParallelLoader", "DeviceLoader", "DataLoaderShard",
                          "prefetch", "Prefetcher", "DataPrefetcher"})
#: Calls that build a sharded source.
SAMPLERS = frozenset({"DistributedSampler", "ElasticDistributedSampler", "DistributedBatchSampler",
                      "DistributedSamplerWrapper"})


def _base(reason: str) -> str:
    return reason.lstrip("~")


def is_source(reason: str) -> bool:
    return _base(reason).startswith(SOURCE)


def has_sources(taint: frozenset) -> bool:
    return any(is_source(r) for r in taint)


def strip_sources(taint: frozenset) -> frozenset:
    """The reasons that can make a condition rank-dependent (no ``#`` sources)."""
    if not has_sources(taint):
        return taint
    return frozenset(r for r in taint if not is_source(r))


def source(what: str, line: int) -> frozenset:
    return frozenset({f"{SOURCE}{what} (line {line})"})


def items(taint: frozenset) -> frozenset:
    """The taint of what iterating a value of taint ``taint`` yields: a sharded source's items
    are this rank's data (``#X`` -> ``%X``), a parameter's items wait for its argument
    (``@N`` -> ``@N*``); any other reason (the rank) stays."""
    out = set()
    for r in taint:
        weak = "~" if r.startswith("~") else ""
        b = _base(r)
        if b.startswith(SOURCE):
            out.add(f"{weak}{DATA}{b[1:]}")
        elif b.startswith("@") and not b.endswith("*"):
            out.add(f"{weak}{b}*")
        else:
            out.add(r)
    return frozenset(out)


def describe_data(reason: str) -> str:
    """A ``%`` reason for a message."""
    what = _base(reason)[1:].replace(" (line ", ", line ")  # "`X` (line N)" -> "`X`, line N)"
    return f"this rank's own share of the data ({what}" + ("" if what.endswith(")") else ")")
