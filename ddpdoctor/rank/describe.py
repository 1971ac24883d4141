"""Metadata of collective arguments, encoded once and cached: never tensor contents, never a
device sync. Tensors are described as ``dtype[shape]`` with ``@device`` when not on the CPU."""

from __future__ import annotations

import json

_tensor_cache: dict[tuple, tuple[str, int]] = {}  # (shape, dtype, device) -> (desc, numel)
_redop_cache: dict[object, str] = {}
MAX_LISTED = 16


def tensor_desc(t) -> tuple[str, int]:
    """(encoded JSON string, numel) of one tensor; non-tensors get their type name."""
    try:
        key = (t.shape, t.dtype, t.device)  # torch.Size hashes as its tuple: no conversion
    except AttributeError:
        return json.dumps(type(t).__name__), 0
    hit = _tensor_cache.get(key)
    if hit is not None:
        return hit
    shape, dtype, dev = tuple(key[0]), key[1], key[2]
    dt = str(dtype).replace("torch.", "")
    where = "" if dev.type == "cpu" else f"@{dev}"
    s = json.dumps(f"{dt}[{','.join(map(str, shape))}]{where}")
    n = 1
    for d in shape:
        n *= d
    if len(_tensor_cache) < 100000:
        _tensor_cache[key] = (s, n)
    return s, n


def tensors_desc(value) -> tuple[list[str], int]:
    """Descriptions of a tensor or a list/tuple of tensors (at most MAX_LISTED listed)."""
    if value is None:
        return [], 0
    if isinstance(value, (list, tuple)):
        out: list[str] = []
        total = 0
        for i, t in enumerate(value):
            if isinstance(t, (list, tuple)):
                sub, n = tensors_desc(t)
                total += n
                if i < MAX_LISTED:
                    out.extend(sub[: MAX_LISTED - len(out)])
                continue
            d, n = tensor_desc(t)
            total += n
            if i < MAX_LISTED:
                out.append(d)
        if len(value) > MAX_LISTED:
            out.append(json.dumps(f"...{len(value)} items"))
        return out, total
    d, n = tensor_desc(value)
    return [d], n


def redop_name(op) -> str:
    name = _redop_cache.get(op)
    if name is None:
        try:
            name = str(op).rsplit(".", 1)[-1].strip(">").split(":")[0].strip()
        except Exception:
            name = "?"
        try:
            _redop_cache[op] = name
        except TypeError:  # unhashable premul-sum ops
            pass
    return name


def object_desc(value) -> str:
    """Type names of objects passed to *_object collectives (never their contents)."""
    if isinstance(value, (list, tuple)):
        names = [type(v).__name__ for v in value[:MAX_LISTED]]
        return json.dumps(names)
    return json.dumps([type(value).__name__])
