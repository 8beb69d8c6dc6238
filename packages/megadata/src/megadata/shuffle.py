"""A shuffle through files: the map side writes one Arrow file per task, its rows grouped by
the reduce task they go to (one record batch each); the reduce side reads its batch of every
file.  Tasks exchange data this way rather than through the Dask scheduler, so nothing but
paths passes through it and a resumed run finds the files where they were.
"""

from pathlib import Path

import numpy as np
import pyarrow as pa

from megacommon.files import atomic_write_bytes


def write_shuffled(path, columns: dict, target: np.ndarray, shards: int) -> None:
    """The map side of a shuffle: the rows as an Arrow file of `shards` record batches,
    batch k holding the rows whose target is k (in their order)."""
    target = np.asarray(target).astype(np.int64)
    batch = pa.record_batch(columns)
    order = np.argsort(target, kind="stable")
    batch = batch.take(pa.array(order))
    ends = np.cumsum(np.bincount(target, minlength=shards))
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, batch.schema) as writer:
        start = 0
        for end in ends.tolist():
            writer.write_batch(batch.slice(start, end - start))
            start = end
    atomic_write_bytes(Path(path), sink.getvalue().to_pybytes())


def read_shuffled(paths: list[str], shard: int, shards: int) -> pa.Table:
    """The reduce side: the rows that each file of `paths` routed to `shard`."""
    batches = []
    for path in paths:
        reader = pa.ipc.open_file(pa.memory_map(str(path)))
        if reader.num_record_batches != shards:
            raise ValueError(
                f"{path}: written for {reader.num_record_batches} shards, not {shards} "
                "(by a run with other settings); delete that stage's work directory"
            )
        batches.append(reader.get_batch(shard))
    return pa.Table.from_batches(batches)
