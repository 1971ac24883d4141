"""Process-group lifecycle: ``init_process_group`` makes this process a rank (its trace file is
opened, the watchdog and exit hooks start); group creation and destruction are recorded so that
every event's group can be resolved to its member ranks."""

from __future__ import annotations

import functools
import os

from ...trace import ops
from .. import recorder as recorder_mod

_GROUP_MAKERS = ops.GROUP_MAKERS


def _group_record(rec, pg, op: str, site: int | None = None) -> None:
    from torch.distributed import distributed_c10d as c10d

    try:
        if pg is None or pg is c10d.GroupMember.NON_GROUP_MEMBER:
            return
        ranks = c10d.get_process_group_ranks(pg)
        name = rec.group_name(pg)
        rec.group_ranks[name] = ranks
        record = {"t": "pg", "op": op, "g": name, "ranks": ranks, "ts": rec.now_us()}
        if site is not None:
            record["site"] = site  # where it was created (collective-misuse names the line)
        rec.emit(record)
    except Exception as exc:
        rec.internal_error(exc)


def _agree_run_id(rec) -> None:
    """Every node's launcher made up its own run id: adopt the first one set in the job's store,
    so that several nodes' trace folders form one run and the watchdogs share a key space."""
    import dataclasses

    from torch.distributed import distributed_c10d as c10d

    try:
        store = c10d._get_default_store()
        mine = rec.settings.run_id or f"pid{os.getpid()}"
        agreed = store.compare_set("ddpdoctor/run_id", "", mine)
        agreed = agreed.decode() if isinstance(agreed, bytes) else str(agreed)
        if agreed and agreed != rec.settings.run_id:
            rec.settings = dataclasses.replace(rec.settings, run_id=agreed)
    except Exception:
        pass  # stores without compare_set: keep the launcher's id


def _after_init(rec, timeout_s: float | None, agree_run_id: bool = True) -> None:
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    pg = c10d._get_default_group()
    if agree_run_id:
        _agree_run_id(rec)
    backend = str(dist.get_backend())
    if backend == "undefined":  # init_process_group() without a backend: one per device type
        try:
            backend = str(dist.get_backend_config())  # e.g. "cpu:gloo,cuda:nccl"
        except Exception:
            pass
    rank, world = dist.get_rank(), dist.get_world_size()
    rec.open_trace(rank, world, backend, timeout_s)
    rec.group_names[id(pg)] = "0"
    rec.group_ranks["0"] = list(range(world))
    rec.emit({"t": "init", "g": "0", "rank": rank, "world": world, "backend": backend,
              "ts": rec.now_us(), "site": rec.sites.current(2)})
    from .. import watchdog
    from . import exit as exithooks

    exithooks.install(rec)
    if rec.settings.hang_timeout > 0:
        watchdog.start(rec)
    if rec.settings.record_files:
        from . import files as fileaudit

        fileaudit.install(rec)


def _rebinding(set_fn):
    """``set_fn`` that also replaces the function in the torch modules that imported it by name
    before ddpdoctor patched it: ``torch.distributed.device_mesh`` binds ``init_process_group``
    while ``import torch`` runs, and ``init_device_mesh`` initialises the job through it. Limited
    to the process-group life cycle: which collectives torch's own modules issue, and how, is
    what the collective wrappers already see through ``torch.distributed``."""
    import sys

    from torch.distributed import distributed_c10d as c10d

    def set_and_rebind(name: str, new) -> None:
        orig = getattr(c10d, name, None)
        set_fn(name, new)
        if orig is None:
            return
        for mod_name, mod in list(sys.modules.items()):
            if mod is not None and mod_name.startswith("torch.") and getattr(mod, name, None) is orig:
                try:
                    setattr(mod, name, new)
                except (AttributeError, TypeError):
                    pass

    return set_and_rebind


def patch(set_fn, mark: str) -> None:
    from torch.distributed import distributed_c10d as c10d

    set_fn = _rebinding(set_fn)
    rec_get = recorder_mod.get
    orig_init = c10d.init_process_group
    if not getattr(orig_init, mark, False):
        @functools.wraps(orig_init)
        def init_process_group(*args, **kwargs):
            rec = rec_get()
            if rec is None or not rec.enabled:
                return orig_init(*args, **kwargs)
            rec.local.depth = getattr(rec.local, "depth", 0) + 1
            try:
                result = orig_init(*args, **kwargs)
            finally:
                rec.local.depth -= 1
            try:
                timeout = kwargs.get("timeout", args[2] if len(args) > 2 else None)
                _after_init(rec, timeout.total_seconds() if timeout is not None else None)
            except Exception as exc:
                rec.internal_error(exc)
            return result

        setattr(init_process_group, mark, True)
        set_fn("init_process_group", init_process_group)

    for name in _GROUP_MAKERS:
        orig = getattr(c10d, name, None)
        if orig is None or getattr(orig, mark, False):
            continue
        set_fn(name, _make_group_maker(name, orig, rec_get, mark))

    orig_destroy = c10d.destroy_process_group
    if not getattr(orig_destroy, mark, False):
        @functools.wraps(orig_destroy)
        def destroy_process_group(*args, **kwargs):
            rec = rec_get()
            group = args[0] if args else kwargs.get("group")
            if rec is not None and rec.enabled and rec.writer is not None:
                try:
                    rec.emit({"t": "pg", "op": "destroy", "g": rec.group_name(group),
                              "ts": rec.now_us(), "site": rec.sites.current(2)})
                    if group is None:
                        rec.writer.sync()
                except Exception as exc:
                    rec.internal_error(exc)
            if rec is not None and group is None and rec.watchdog is not None:
                # No collective can hang once the job's group is gone, and its store may be
                # gone too (its host rank exits): polling it would make C++ print warnings
                # the program never prints untraced. A later init starts a new watchdog.
                wd, rec.watchdog = rec.watchdog, None
                try:
                    # what a rank still waiting for this one will be told, while the store lives
                    wd.publish_exit({"how": "destroyed the process group", "seq": rec.position()})
                    wd.stop()
                except Exception as exc:
                    rec.internal_error(exc)
            result = orig_destroy(*args, **kwargs)
            if rec is not None:
                # Names are cached by id(): a later group may reuse a destroyed one's id.
                if group is None:
                    rec.group_names.clear()
                else:
                    rec.group_names.pop(id(group), None)
            return result

        setattr(destroy_process_group, mark, True)
        set_fn("destroy_process_group", destroy_process_group)


def _make_group_maker(name, orig, rec_get, mark):
    """Group creation is collective over the parent group: it is one event in its sequence."""

    @functools.wraps(orig)
    def maker(*args, **kwargs):
        rec = rec_get()
        if rec is None or not rec.enabled or getattr(rec.local, "depth", 0):
            return orig(*args, **kwargs)
        local_sync = bool(kwargs.get("use_local_synchronization", False))
        site = rec.sites.current(2)
        start = rec.now_us()
        seq = 0 if local_sync else rec.next_seq("0")
        rec.local.depth = 1
        try:
            result = orig(*args, **kwargs)
        finally:
            rec.local.depth = 0
        try:
            if seq:
                rec.emit_line(f'{{"t":"c","op":"{name}","g":"0","s":{seq},"ts":{start},'
                              f'"d":{rec.now_us() - start},"site":{site}}}')
            groups = []
            if isinstance(result, tuple):  # new_subgroups*: (this rank's subgroup, all subgroups)
                groups = [result[0]] + [g for g in (result[1] or []) if g is not result[0]]
            else:
                groups = [result]
            for g in groups:
                _group_record(rec, g, name, site)
        except Exception as exc:
            rec.internal_error(exc)
        return result

    setattr(maker, mark, True)
    return maker

