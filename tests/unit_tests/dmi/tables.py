"""Tensor tables back to records, for comparing what a stage wrote with what was published."""

import pyarrow as pa

from megatron.core.dmi.key import RecordKey
from megatron.core.dmi.records import Record


def table_to_records(table: pa.Table) -> list[Record]:
    """The records of a tensor table (``TENSOR_SCHEMA``), in row order."""
    out = []
    for row in table.to_pylist():
        payload = row.pop("payload")
        out.append(Record(RecordKey.from_flat(row), bytes(payload)))
    return out
