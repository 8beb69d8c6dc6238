"""Dedup step 9 (megadata.stages.dedup): the walks' report lines and removed nodes gathered into
clusters.jsonl, removed.json and the sorted removed nodes that step 10 maps."""

import io
import json
from pathlib import Path

import numpy as np

from megacommon.files import atomic_write_bytes, atomic_write_json
from megadata.documents import read_table

REMOVED_NODES = "removed-nodes.npy"  # the removed documents' nodes, sorted (step 9)


def write_report(
    chunk_paths: list[str], out_dir: str, docs_in: int, bands: int, rows: int, counts: dict
) -> dict:
    """Step 9: clusters.jsonl (one line per kept document that removed others, by its id)
    and removed.json."""
    clusters = [json.loads(line) for p in chunk_paths for line in Path(p).read_text().splitlines()]
    clusters.sort(key=lambda c: c["survivor"])
    removed = sorted(m["doc_id"] for c in clusters for m in c["removed"])
    nodes = [np.zeros(0, np.int64)]
    for p in chunk_paths:
        if not removed_nodes_path(p).exists():  # a shard walked by an earlier megadata
            raise FileNotFoundError(
                f"{removed_nodes_path(p)} is missing: delete {Path(p).parent} to walk again"
            )
        nodes.append(read_table(removed_nodes_path(p)).column("node").to_numpy())
    nodes = np.concatenate(nodes)  # write_removed_nodes sorts them
    if len(nodes) != len(removed):
        raise ValueError(f"dedup: {len(nodes)} removed nodes for {len(removed)} removed ids")
    write_removed_nodes(Path(out_dir) / REMOVED_NODES, nodes)
    atomic_write_bytes(Path(out_dir) / "clusters.jsonl", jsonl(clusters))
    atomic_write_json(Path(out_dir) / "removed.json", removed)
    return {
        "docs_in": docs_in,
        "docs_out": docs_in - len(removed),
        "extra": {
            "bands": bands,
            "rows": rows,
            "candidate_pairs": counts["candidate_pairs"],
            "verified_pairs": counts["verified_pairs"],
            "bucket_pairs": counts["bucket_pairs"],
            "components": counts["components"],
            "clusters": len(clusters),
            "removed": len(removed),
        },
    }


def jsonl(rows: list[dict]) -> bytes:
    return "".join(json.dumps(r, sort_keys=True) + "\n" for r in rows).encode()


def write_removed_nodes(path: Path, nodes: np.ndarray) -> None:
    """The sorted int64 nodes `remove_partition` reads, as one .npy array it can map."""
    buffer = io.BytesIO()
    np.save(buffer, np.sort(np.asarray(nodes, dtype=np.int64)))
    atomic_write_bytes(Path(path), buffer.getvalue())


def removed_nodes_path(chunk_path: str) -> Path:
    return Path(chunk_path).with_suffix(".removed.arrow")
