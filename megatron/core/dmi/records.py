"""The record: one captured tensor plus its key (key.py), and the Arrow tables records travel in.

This is the contract between every stage of the pipeline (hooks -> transport -> drain -> sinks ->
reader). Payloads are the tensor's raw little-endian bytes in C order, so every dtype (bf16 included)
round-trips bitwise.
"""

from __future__ import annotations

import dataclasses
import functools
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa

from megatron.core.dmi.errors import DMIError
from megatron.core.dmi.key import ITEM_SIZE, PHASES, ParallelCoords, RecordKey

if TYPE_CHECKING:
    import torch


@functools.cache
def _torch_dtypes() -> dict:
    import torch

    return {name: getattr(torch, name) for name in ITEM_SIZE}


@functools.cache
def _names_by_dtype() -> dict:
    return {v: k for k, v in _torch_dtypes().items()}


def __getattr__(name: str):
    """``DTYPE_BY_NAME`` (name -> torch.dtype) and ``NAME_BY_DTYPE``, built on first use."""
    if name == "DTYPE_BY_NAME":
        return _torch_dtypes()
    if name == "NAME_BY_DTYPE":
        return _names_by_dtype()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class UnsupportedDtypeError(DMIError, TypeError):
    """A tensor's dtype is not one DMI records (``ITEM_SIZE`` lists them)."""


def dtype_name(dtype: torch.dtype) -> str:
    """The name of a torch dtype in the tables; ``UnsupportedDtypeError`` for a dtype DMI does not capture."""
    try:
        return _names_by_dtype()[dtype]
    except KeyError:
        raise UnsupportedDtypeError(
            f"DMI cannot capture tensors of dtype {dtype} (it records {', '.join(ITEM_SIZE)})"
        ) from None


@dataclass
class Record:
    """A key and its payload bytes (host memory, owned by the record)."""

    key: RecordKey
    payload: bytes

    def tensor(self) -> torch.Tensor:
        """The payload as a tensor of the key's dtype and shape (a copy)."""
        return payload_to_tensor(self.payload, self.key.dtype, self.key.shape)

    @property
    def checksum(self) -> int:
        """CRC-32 of the payload."""
        return zlib.crc32(self.payload)


def tensor_to_payload(t: torch.Tensor) -> bytes:
    """Raw bytes of a host tensor (C order, native little-endian)."""
    import torch

    t = t.detach().contiguous()
    if t.numel() == 0:
        return b""
    return t.reshape(-1).view(torch.uint8).numpy().tobytes()


# numpy's dtype of each stored dtype. numpy has no bfloat16: its payloads are read as their uint16 bit patterns,
# which ``payload_to_array`` widens to float32 (exact: bfloat16 is float32's upper half).
NUMPY_DTYPE: dict[str, str] = {
    "float32": "<f4",
    "float64": "<f8",
    "bfloat16": "<u2",
    "float16": "<f2",
    "int32": "<i4",
    "int64": "<i8",
    "uint8": "u1",
    "bool": "?",
}


def payload_to_array(payload: bytes, dtype: str, shape: Sequence[int]) -> np.ndarray:
    """The values of a payload without torch: a read-only numpy view of its bytes in the key's shape, bfloat16
    widened to float32 (a copy; every value exact, NaN payloads included: ``array_to_tensor`` narrows it back
    bitwise)."""
    flat = np.frombuffer(payload, dtype=NUMPY_DTYPE[dtype])
    if dtype == "bfloat16":
        flat = (flat.astype(np.uint32) << 16).view(np.float32)
    return flat.reshape(tuple(shape))


def array_to_tensor(values: np.ndarray, dtype: str) -> torch.Tensor:
    """The torch tensor of ``dtype`` holding ``values`` (as ``payload_to_array`` gives them: bfloat16 as float32
    widened from bfloat16, narrowed back by dropping the low 16 bits, which are zero); a copy."""
    import torch

    values = np.array(values, dtype=np.float32 if dtype == "bfloat16" else NUMPY_DTYPE[dtype], order="C", copy=True)
    if dtype == "bfloat16":
        return torch.from_numpy((values.view(np.uint32) >> 16).astype(np.uint16).view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(values)


def payload_to_tensor(payload: bytes, dtype: str, shape: Sequence[int]) -> torch.Tensor:
    """The tensor of a payload's raw bytes (a copy: the payload stays untouched)."""
    import torch

    torch_dtype = _torch_dtypes()[dtype]
    if len(payload) == 0:
        return torch.empty(tuple(shape), dtype=torch_dtype)
    flat = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    return flat.view(torch_dtype).reshape(tuple(shape))


# The producer's coordinates as columns (tensor, drops and topology tables).
COORD_COLUMNS: list[tuple[str, pa.DataType]] = [(f.name, pa.int32()) for f in dataclasses.fields(ParallelCoords)]

# Arrow schema of the tensor table: shared by spool files, the chDB store and the server store.
KEY_COLUMNS: list[tuple[str, pa.DataType]] = [
    ("run_id", pa.string()),
    ("phase", pa.string()),
    ("iteration", pa.int64()),
    ("attempt", pa.int32()),
    ("microbatch", pa.int32()),
    ("invocation", pa.int8()),
    ("layer", pa.int32()),
    ("output", pa.string()),
    *COORD_COLUMNS,
    ("shard_index", pa.int32()),
    ("shard_count", pa.int32()),
    ("token_start", pa.int64()),
    ("token_end", pa.int64()),
    ("token_total", pa.int64()),
    ("dtype", pa.string()),
    ("shape", pa.list_(pa.int64())),
]
TENSOR_SCHEMA = pa.schema(
    KEY_COLUMNS + [("nbytes", pa.int64()), ("checksum", pa.uint32()), ("payload", pa.large_binary())]
)


def key_columns(keys: Sequence[RecordKey]) -> dict[str, pa.Array]:
    """The ``KEY_COLUMNS`` of a batch, one Arrow array per column."""
    flat = [k.flat() for k in keys]
    return {name: pa.array([f[name] for f in flat], type=t) for name, t in KEY_COLUMNS}


# Site id -> its static key (a list indexed by id, or a dict).
Sites = Sequence[RecordKey] | dict[int, RecordKey]
# One record's descriptor row as the native ring hands it out (take_into, raw spool segments):
# uint64 words in this order (csrc/dmi/spool_writer.h, kTakeWords).
DESCRIPTOR_COLUMNS = ("seq", "site", "iteration", "microbatch", "attempt", "phase", "invocation", "nbytes", "crc32")


def descriptor_key_columns(sites: Sites, rows: np.ndarray) -> dict[str, pa.Array]:
    """The ``KEY_COLUMNS`` of descriptor ``rows`` (n x DESCRIPTOR_COLUMNS uint64): static columns
    from ``sites`` (indexed by each row's site id), dynamic ones from the rows themselves."""
    col = {name: rows[:, i] for i, name in enumerate(DESCRIPTOR_COLUMNS)}
    out = key_columns([sites[i] for i in col["site"].tolist()])
    types = dict(KEY_COLUMNS)
    for name in ("iteration", "microbatch", "attempt", "invocation"):
        out[name] = pa.array(col[name].astype(types[name].to_pandas_dtype()), type=types[name])
    out["phase"] = pa.array([PHASES[i] for i in col["phase"].tolist()], type=pa.string())
    return out


def descriptor_table(sites: Sites, rows: np.ndarray, data: pa.Buffer) -> pa.Table:
    """The table of descriptor ``rows`` whose payloads lie back to back in ``data``."""
    offsets = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum(rows[:, DESCRIPTOR_COLUMNS.index("nbytes")], out=offsets[1:])
    crc = rows[:, DESCRIPTOR_COLUMNS.index("crc32")].astype(np.uint32)
    return batch_table(descriptor_key_columns(sites, rows), offsets, data, crc)


def records_to_table(records: Sequence[Record]) -> pa.Table:
    """Columnar batch of records, the unit every sink and spool file deals in."""
    columns = key_columns([r.key for r in records])
    columns = [columns[name] for name, _ in KEY_COLUMNS]
    columns += [
        pa.array([len(r.payload) for r in records], type=pa.int64()),
        pa.array([r.checksum for r in records], type=pa.uint32()),
        pa.array([r.payload for r in records], type=pa.large_binary()),
    ]
    return pa.Table.from_arrays(columns, schema=TENSOR_SCHEMA)


def batch_table(
    key_columns: dict[str, pa.Array], offsets: np.ndarray, data: pa.Buffer, checksums: np.ndarray
) -> pa.Table:
    """The table of a batch whose payloads lie back to back in ``data`` (record i is
    ``data[offsets[i]:offsets[i + 1]]``, its zlib CRC-32 ``checksums[i]``). The payload column
    views ``data`` without copying it."""
    n = len(offsets) - 1
    payload = pa.LargeBinaryArray.from_buffers(pa.large_binary(), n, [None, pa.py_buffer(offsets), data])
    columns = [key_columns[name] for name, _ in KEY_COLUMNS]
    columns += [pa.array(np.diff(offsets), type=pa.int64()), pa.array(checksums, type=pa.uint32()), payload]
    return pa.Table.from_arrays(columns, schema=TENSOR_SCHEMA)


def table_nbytes(table: pa.Table) -> int:
    """Payload bytes of a tensor table (0 for tables without an ``nbytes`` column). Summed with
    numpy, which keeps the GIL, rather than Arrow compute, which drops and re-takes it (this
    runs on the drain thread; see NativeRingTransport.take_table)."""
    if "nbytes" not in table.schema.names or table.num_rows == 0:
        return 0
    return int(sum(int(c.to_numpy().sum()) for c in table.column("nbytes").chunks))
