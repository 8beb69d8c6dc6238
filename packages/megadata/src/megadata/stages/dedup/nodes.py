"""A document of the dedup grouping known by its node number, `partition << 32 | row`: the
values of its columns, and the hubs (one per band) step 5 gave it."""

from pathlib import Path

import numpy as np
import pyarrow as pa

from megadata.documents import read_table


def take(paths: list[str], nodes: np.ndarray, column: str) -> list:
    """`column` of each node's document: row `node & 0xFFFFFFFF` of `paths[node >> 32]`,
    reading (memory-mapped) only the partitions and rows asked for."""
    values = [None] * len(nodes)
    parts = nodes >> 32
    for part in np.unique(parts).tolist():
        where = np.flatnonzero(parts == part)
        rows = pa.array(nodes[where] & 0xFFFFFFFF)
        got = read_table(Path(paths[part])).column(column).take(rows).to_pylist()
        for i, value in zip(where.tolist(), got, strict=True):
            values[i] = value
    return values


def hub_matrix(members: pa.Table) -> np.ndarray:
    column = members.column("hubs").combine_chunks()
    width = members.schema.field("hubs").type.list_size
    return column.flatten().to_numpy().reshape(-1, width)
