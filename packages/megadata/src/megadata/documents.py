"""Documents between stages: Arrow IPC files of (doc_id, source, url, title, text).

Every file a stage writes goes to a temporary name in the same directory and is
renamed into place only when complete, so a reader (or a resumed run) never
sees half a file.  Small per-file facts (a stage's counts) ride in the
schema metadata of the same file, so data and counts appear together or not at all.
"""

import json
import os
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from megacommon.files import atomic_write_bytes

DOC_SCHEMA = pa.schema(
    [
        ("doc_id", pa.string()),
        ("source", pa.string()),
        ("url", pa.string()),
        ("title", pa.string()),
        ("text", pa.string()),
    ]
)
BATCH_ROWS = 1024


def write_table(path: Path, table: pa.Table, meta: dict | None = None) -> None:
    """Write `table` as an Arrow IPC file at `path`, atomically, with `meta` in its schema."""
    if meta is not None:
        table = table.replace_schema_metadata({b"megadata": json.dumps(meta, sort_keys=True)})
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, table.schema) as writer:
        for batch in table.to_batches(max_chunksize=BATCH_ROWS):
            writer.write_batch(batch)
    atomic_write_bytes(path, sink.getvalue().to_pybytes())


def write_docs(path: Path, docs: Iterable[dict], meta: dict | None = None) -> None:
    rows = list(docs)
    table = pa.Table.from_pylist(
        [{k: d.get(k) or "" for k in DOC_SCHEMA.names} for d in rows], schema=DOC_SCHEMA
    )
    write_table(path, table, meta)


def write_kept(
    path: Path, table: pa.Table, keep, meta: dict | None = None, texts: list[str] | None = None
) -> pa.Table:
    """The rows of a partition's `table` where `keep` is true (with `texts`, the kept rows'
    new texts, in order), written as `write_docs` writes them (the same bytes: tested)
    without turning documents into Python objects; returns them."""
    kept = table.filter(pa.array(keep, pa.bool_())).combine_chunks()
    if texts is not None:
        at = kept.schema.get_field_index("text")
        kept = kept.set_column(at, kept.schema.field(at), pa.array(texts, pa.string()))
    write_table(path, kept.replace_schema_metadata(None), meta)
    return kept


def text_bytes(docs: Iterable[dict]) -> int:
    """UTF-8 bytes of the documents' text (the MB columns of the stage table)."""
    return sum(len(d["text"].encode("utf-8")) for d in docs)


def read_table(path: Path, memory_map: bool = True) -> pa.Table:
    path = Path(path)
    try:
        source = pa.memory_map(str(path)) if memory_map else pa.OSFile(str(path))
        return pa.ipc.open_file(source).read_all()
    except (pa.ArrowInvalid, OSError) as e:
        raise ValueError(f"{path}: not a readable Arrow IPC file ({e})") from e


def read_meta(path: Path) -> dict:
    schema = pa.ipc.open_file(pa.memory_map(str(path))).schema
    raw = (schema.metadata or {}).get(b"megadata")
    return json.loads(raw) if raw else {}


def read_docs(path: Path) -> Iterator[dict]:
    table = read_table(path)
    for batch in table.to_batches(max_chunksize=BATCH_ROWS):
        yield from batch.to_pylist()


def _counts(table: pa.Table) -> tuple[int, int]:
    """(documents, UTF-8 bytes of text) of a partition, from its Arrow columns."""
    return table.num_rows, pc.sum(pc.binary_length(table.column("text"))).as_py() or 0


def link_partition(in_path: str, out_path: str) -> dict:
    """The partition unchanged (a hard link: no bytes copied), counted from its Arrow columns."""
    rows, nbytes = _counts(read_table(Path(in_path)))
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.link.tmp")
    tmp.unlink(missing_ok=True)
    try:
        os.link(in_path, tmp)
    except OSError:  # another file system, or one without links
        shutil.copyfile(in_path, tmp)
    os.replace(tmp, out)
    return {"docs_in": rows, "docs_out": rows, "bytes_in": nbytes, "bytes_out": nbytes}


def drop_rows(in_path: str, out_path: str, rows: np.ndarray) -> dict:
    """The partition without the documents at `rows` (a link when there are none): Arrow
    columns filtered, no document turned into Python objects."""
    if not len(rows):
        return link_partition(in_path, out_path)
    table = read_table(Path(in_path))
    keep = np.ones(table.num_rows, dtype=bool)
    keep[rows] = False
    kept = write_kept(Path(out_path), table, keep)
    (docs_in, bytes_in), (docs_out, bytes_out) = _counts(table), _counts(kept)
    return {"docs_in": docs_in, "docs_out": docs_out, "bytes_in": bytes_in, "bytes_out": bytes_out}
