"""The op table: one entry per recorded ``op`` name, read by the patches that record it and by
every reader (loader, checks, hang diagnosis, timeline). Adding a recorded op means adding its row
here (and its wrapper in ``rank.patches``); the sets below are derived from the table.

An op's ``kind``:

- ``collective``: a sequence event every member of the group issues (``t: "c"``);
- ``p2p``: a message on a channel (``t: "p"``);
- ``ddp``: DDP's own communication or construction, recorded as sequence events (or ``t: "e"``);
- ``group``: process-group construction (``t: "pg"``, and a sequence event where it communicates).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Op:
    """One recorded op. Parameter names are those of ``torch.distributed``'s function."""

    name: str
    kind: str
    #: Tensor parameters every rank passes with the same metadata in a correct program.
    primary: tuple[str, ...] = ()
    #: Other tensor parameters (outputs, lists), recorded but not compared.
    other: tuple[str, ...] = ()
    #: Parameters naming the root rank.
    roots: tuple[str, ...] = ()
    #: Object parameters (object collectives, object p2p).
    objects: tuple[str, ...] = ()
    #: p2p: the parameters naming the peer, and ``send`` or ``recv``.
    peer: tuple[str, ...] = ()
    direction: str = ""
    #: Combines values across ranks under a reduce op (recorded as ``rop``).
    reduces: bool = False
    #: Overwrites a tensor on every rank (``broadcast``): like a reduction for DDP's gradients.
    overwrites: bool = False
    #: A barrier (RankTrace.after_barrier, sync-overhead).
    barrier: bool = False
    #: Tensors legitimately differ in shape across ranks.
    asymmetric: bool = False
    #: One DDP training step half (forward / backward).
    ddp_step: bool = False
    #: One-off construction: its duration is not waiting for peers.
    construction: bool = False
    #: Recorded under this name instead (torch 2.13 added *_single spellings of two collectives).
    canonical: str = ""
    #: How a report names it in a sentence, and in a hang table (default: the op name).
    description: str = ""
    label: str = ""


_ROOT_DST = ("dst", "group_dst")
_ROOT_SRC = ("src", "group_src")

TABLE: tuple[Op, ...] = (
    Op("barrier", "collective", barrier=True),
    Op("monitored_barrier", "collective", barrier=True),
    Op("all_reduce", "collective", ("tensor",), reduces=True),
    Op("all_reduce_coalesced", "collective", ("tensors",), reduces=True),
    Op("reduce", "collective", ("tensor",), roots=_ROOT_DST, reduces=True),
    Op("broadcast", "collective", ("tensor",), roots=_ROOT_SRC, overwrites=True),
    Op("all_gather", "collective", ("tensor",), ("tensor_list",)),
    Op("all_gather_into_tensor", "collective", ("input_tensor",), ("output_tensor",)),
    Op("all_gather_single", "collective", ("input_tensor",), ("output_tensor",),
       canonical="all_gather_into_tensor"),
    Op("all_gather_coalesced", "collective", ("input_tensor_list",), ("output_tensor_lists",)),
    Op("reduce_scatter", "collective", ("output",), ("input_list",), reduces=True),
    Op("reduce_scatter_tensor", "collective", ("input",), ("output",), reduces=True),
    Op("reduce_scatter_single", "collective", ("input",), ("output",), reduces=True,
       canonical="reduce_scatter_tensor"),
    Op("all_to_all", "collective", ("input_tensor_list",), ("output_tensor_list",), asymmetric=True),
    Op("all_to_all_single", "collective", ("input",), ("output",), asymmetric=True),
    Op("gather", "collective", ("tensor",), ("gather_list",), roots=_ROOT_DST),
    Op("scatter", "collective", ("tensor",), ("scatter_list",), roots=_ROOT_SRC),
    Op("all_gather_object", "collective", objects=("obj",)),
    Op("gather_object", "collective", roots=_ROOT_DST, objects=("obj",)),
    Op("broadcast_object_list", "collective", roots=_ROOT_SRC, objects=("object_list",)),
    Op("scatter_object_list", "collective", roots=_ROOT_SRC, objects=("scatter_object_output_list",)),
    Op("send", "p2p", ("tensor",), peer=_ROOT_DST, direction="send"),
    Op("recv", "p2p", ("tensor",), peer=_ROOT_SRC, direction="recv"),
    Op("isend", "p2p", ("tensor",), peer=_ROOT_DST, direction="send"),
    Op("irecv", "p2p", ("tensor",), peer=_ROOT_SRC, direction="recv"),
    Op("send_object_list", "p2p", objects=("object_list",), peer=_ROOT_DST, direction="send"),
    Op("recv_object_list", "p2p", objects=("object_list",), peer=_ROOT_SRC, direction="recv"),
    Op("ddp_init", "ddp", construction=True, description="DDP construction (it broadcasts parameters)",
       label="DDP construction"),
    Op("ddp_forward", "ddp", ddp_step=True, description="a DDP forward (it broadcasts buffers)",
       label="DDP forward (buffers)"),
    Op("ddp_backward", "ddp", ddp_step=True, description="a DDP backward (it all-reduces gradients)",
       label="DDP backward (gradients)"),
    Op("join", "ddp"),
    Op("join_enter", "ddp"),
    Op("new_group", "group", construction=True),
    Op("new_subgroups", "group", construction=True),
    Op("new_subgroups_by_enumeration", "group", construction=True),
    Op("split_group", "group", construction=True),
)

OPS: dict[str, Op] = {op.name: op for op in TABLE}


def _names(pred) -> frozenset[str]:
    return frozenset(op.name for op in TABLE if pred(op))


#: Collectives wrapped in ``torch.distributed`` (including the *_single spellings).
COLLECTIVES = tuple(op for op in TABLE if op.kind == "collective")
#: Point-to-point ops wrapped in ``torch.distributed``.
P2P = tuple(op for op in TABLE if op.kind == "p2p")
#: Ops that combine values across ranks under a reduce op.
REDUCING = _names(lambda op: op.reduces)
#: Ops that change a tensor on every rank (reductions and broadcast): compared with DDP gradients.
CHANGING_TENSORS = _names(lambda op: op.reduces or op.overwrites)
BARRIER_OPS = _names(lambda op: op.barrier)
ASYMMETRIC_OPS = _names(lambda op: op.asymmetric)
#: DDP's forward and backward, one training step.
DDP_STEPS = _names(lambda op: op.ddp_step)
#: DDP's own ops (construction, steps, Join).
DDP_OPS = _names(lambda op: op.kind == "ddp")
#: Ops whose duration is not waiting for peers (one-off construction).
CONSTRUCTION = _names(lambda op: op.construction)
#: Process-group constructors patched to record ``pg`` records.
GROUP_MAKERS = tuple(op.name for op in TABLE if op.kind == "group")
#: Spelling recorded for an op with two names.
CANONICAL = {op.name: op.canonical for op in TABLE if op.canonical}


def describe(op: str) -> str:
    """How a report names ``op`` in a sentence ("a DDP backward (it all-reduces gradients)")."""
    entry = OPS.get(op)
    return entry.description if entry is not None and entry.description else op


def label(op: str) -> str:
    """How a hang table names ``op`` ("DDP backward (gradients)")."""
    entry = OPS.get(op)
    return entry.label if entry is not None and entry.label else op
