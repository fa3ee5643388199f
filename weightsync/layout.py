"""Bucket layout of a weight update: where each named tensor lives in a flat byte buffer. Buckets hold tensors of one
dtype back to back, each at a multiple of :data:`ALIGN` bytes, at most ``bucket_bytes`` per bucket unless one tensor
is larger (tensors are never split, so each stays a plain view). A whole update is the buckets one after another."""

from __future__ import annotations

import hashlib
import itertools
import math
from typing import Iterable, Mapping, Sequence

import msgspec
import torch

from core.messages import Bucket, WeightUpdateHeader

# 256 B: every tensor view satisfies any dtype's alignment and CUDA's coalescing preference
ALIGN = 256

ITEMSIZE = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1,
            "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1}


class LayoutError(ValueError):
    """Tensors do not match the layout they are published into or applied from."""


def _round_up(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def tensor_nbytes(dtype: str, shape: Sequence[int]) -> int:
    return math.prod(shape) * ITEMSIZE[dtype]


def plan(version: int, specs: Iterable[tuple[str, str, Sequence[int]]], bucket_bytes: int) -> WeightUpdateHeader:
    """Header for ``(name, dtype name, shape)`` tensors: dtypes grouped by first appearance, tensors in order."""
    if bucket_bytes < 1:
        raise LayoutError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    rows, by_dtype = [], {}
    for name, dtype, shape in specs:
        if dtype not in ITEMSIZE:
            raise LayoutError(f"tensor {name!r}: unsupported dtype {dtype!r} (have {sorted(ITEMSIZE)})")
        shape = [int(d) for d in shape]
        if any(d < 0 for d in shape):
            raise LayoutError(f"tensor {name!r}: negative dimension in {shape}")
        by_dtype.setdefault(dtype, []).append((name, tensor_nbytes(dtype, shape)))
        rows.append((name, dtype, shape))
    if not rows:
        raise LayoutError("no tensors to lay out")
    names, dtypes, shapes = map(list, zip(*rows))
    if len(set(names)) != len(names):
        raise LayoutError(f"duplicate tensor names: {sorted({n for n in names if names.count(n) > 1})[:5]}")
    buckets: list[Bucket] = []
    for dtype, tensors in by_dtype.items():
        cur, end = [], 0  # the bucket being filled: (name, offset) pairs, and its aligned size so far
        for name, size in tensors:
            if cur and _round_up(end + size) > bucket_bytes:
                buckets.append(Bucket(dtype, *map(list, zip(*cur)), end))
                cur, end = [], 0
            cur.append((name, end))
            end = _round_up(end + size)
        buckets.append(Bucket(dtype, *map(list, zip(*cur)), end))
    return WeightUpdateHeader(version, names, dtypes, shapes, buckets)


def with_version(header: WeightUpdateHeader, version: int) -> WeightUpdateHeader:
    return msgspec.structs.replace(header, version=version)


def layout_hash(header: WeightUpdateHeader) -> bytes:
    """32-byte digest of everything but the version: equal hashes mean interchangeable buffers."""
    body = msgspec.msgpack.encode([header.names, header.dtypes, header.shapes, header.buckets])
    return hashlib.sha256(body).digest()


def bucket_starts(header: WeightUpdateHeader) -> list[int]:
    """Byte offset of each bucket inside the flat buffer of a whole update."""
    return list(itertools.accumulate([b.nbytes for b in header.buckets[:-1]], initial=0))


def total_nbytes(header: WeightUpdateHeader) -> int:
    return sum(b.nbytes for b in header.buckets)


def payload_nbytes(header: WeightUpdateHeader) -> int:
    """Bytes of tensor data, without alignment padding."""
    return sum(tensor_nbytes(d, s) for d, s in zip(header.dtypes, header.shapes))


def torch_dtype(name: str) -> torch.dtype:
    if name not in ITEMSIZE:
        raise LayoutError(f"unsupported dtype {name!r}")
    return getattr(torch, name)


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in ITEMSIZE:
        raise LayoutError(f"unsupported dtype {dtype} (have {sorted(ITEMSIZE)})")
    return name


def header_for(version: int, named: Mapping[str, torch.Tensor], bucket_bytes: int) -> WeightUpdateHeader:
    return plan(version, ((n, dtype_name(t.dtype), tuple(t.shape)) for n, t in named.items()), bucket_bytes)


def packed_nbytes(header: WeightUpdateHeader, bucket: int) -> int:
    """Bytes of ``bucket``'s tensors back to back, without padding."""
    b, shapes = header.buckets[bucket], dict(zip(header.names, header.shapes))
    return sum(tensor_nbytes(b.dtype, shapes[name]) for name in b.names)


def views(header: WeightUpdateHeader, flat: torch.Tensor, bucket: int | None = None, *,
          packed: bool = False) -> dict[str, torch.Tensor]:
    """Typed, shaped views into ``flat`` (1-D uint8): the whole update, or only ``bucket``; ``packed``:
    that bucket's tensors back to back with no padding (what a server's flattened-bucket buffer holds)."""
    if flat.dtype != torch.uint8 or flat.dim() != 1:
        raise LayoutError(f"flat buffer must be 1-D uint8, got {flat.dtype} {tuple(flat.shape)}")
    need = (packed_nbytes(header, bucket) if packed
            else header.buckets[bucket].nbytes if bucket is not None else total_nbytes(header))
    if flat.numel() < need:
        raise LayoutError(f"flat buffer has {flat.numel()} bytes, layout needs {need}")
    shapes, out = dict(zip(header.names, header.shapes)), {}
    chosen = [(0, header.buckets[bucket])] if bucket is not None else zip(bucket_starts(header), header.buckets)
    for start, b in chosen:
        dt, lo = torch_dtype(b.dtype), start
        for name, off in zip(b.names, b.offsets):
            lo, size = lo if packed else start + off, tensor_nbytes(b.dtype, shapes[name])
            out[name] = flat[lo : lo + size].view(dt).view(shapes[name])
            lo += size
    return out


def check_targets(header: WeightUpdateHeader, named: Mapping[str, torch.Tensor], *, role: str,
                  same_dtype: bool = False) -> None:
    """:class:`LayoutError` unless ``named`` has exactly the header's names and shapes. Readers may
    hold other dtypes (copies convert), never other shapes (``copy_`` would silently broadcast)."""
    if len(named) != len(header.names) or any(n not in named for n in header.names):
        missing, extra = sorted(set(header.names) - set(named)), sorted(set(named) - set(header.names))
        raise LayoutError(f"{role}: tensor names differ from the published layout; missing {missing[:5]}"
                          f"{'...' * (len(missing) > 5)}, unexpected {extra[:5]}{'...' * (len(extra) > 5)}")
    for name, shape, dtype in zip(header.names, header.shapes, header.dtypes):
        t = named[name]
        if list(t.shape) != shape:
            raise LayoutError(f"{role}: tensor {name!r} has shape {list(t.shape)}, published layout has {shape}")
        if same_dtype and t.dtype is not torch_dtype(dtype):  # per publish: no string building
            raise LayoutError(f"{role}: tensor {name!r} has dtype {dtype_name(t.dtype)}, published layout has {dtype}")
