"""The datasets datagen writes: each split's columns, and the parquet writer that streams its rows."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

SPLITS = ("rl", "av_sft", "ar_sft", "eval")
"""Every split datagen can write, in file order."""
EXTRA_COLUMNS: Mapping[str, tuple[str, ...]] = {
    "rl": (),
    "av_sft": ("explanation", "response"),
    "ar_sft": ("explanation",),
    "eval": ("explanation", "response"),
}
"""String columns each split adds to the columns every split has."""


def split_schema(split: str, d_model: int) -> pa.Schema:
    message = pa.struct([("role", pa.string()), ("content", pa.string())])
    return pa.schema(
        [
            ("prompt", pa.string() if split == "ar_sft" else pa.list_(message)),
            ("activation_vector", pa.list_(pa.float32(), d_model)),
            ("doc_id", pa.string()),
            ("n_raw_tokens", pa.int64()),
            ("activation_layer", pa.int64()),
            ("position", pa.int64()),
            ("context", pa.string()),
            *[(name, pa.string()) for name in EXTRA_COLUMNS[split]],
        ]
    )


class _SplitWriter:
    """Streams one split's rows to parquet, a row group at a time."""

    def __init__(self, path: Path, split: str, d_model: int, row_group_size: int) -> None:
        self.path, self.d_model = path, d_model
        self.schema = split_schema(split, d_model)
        self.row_group_size = row_group_size
        self.buffer: list[dict[str, Any]] = []
        self.rows = 0
        self._writer: pq.ParquetWriter | None = None

    def add(self, row: dict[str, Any]) -> None:
        self.buffer.append(row)
        if len(self.buffer) >= self.row_group_size:
            self.flush()

    def flush(self) -> None:
        if not self.buffer:
            return
        acts = np.stack([r["activation_vector"] for r in self.buffer]).astype(np.float32)
        columns = {name: [r[name] for r in self.buffer] for name in self.schema.names if name != "activation_vector"}
        columns["activation_vector"] = pa.FixedSizeListArray.from_arrays(pa.array(acts.reshape(-1)), self.d_model)
        table = pa.table({name: columns[name] for name in self.schema.names}, schema=self.schema)
        if self._writer is None:
            self._writer = pq.ParquetWriter(self.path, self.schema)
        self._writer.write_table(table, row_group_size=self.row_group_size)
        self.rows += len(self.buffer)
        self.buffer = []

    def close(self) -> None:
        self.flush()
        if self._writer is not None:
            self._writer.close()
