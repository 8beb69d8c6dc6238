"""Dedup steps 4-6 (megadata.stages.dedup): the connected components of the LSH links, by
min-label propagation in rounds, and each component's members in the survivor order with the
candidates of its first document."""

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from megadata.documents import read_table, write_table
from megadata.shuffle import read_shuffled as _read_shuffled
from megadata.shuffle import write_shuffled as _write_shuffled
from megadata.stages.dedup.nodes import hub_matrix, take


def label_round(
    edge_paths: list[str], shard: int, previous: str | None, out_dir: str, shards: int
) -> dict:
    """Step 4, one round for the nodes of one shard: take the smallest label received,
    spread labels over the shard's own links until they settle, and send a label that
    dropped (every label, in round 0) to the neighbours in other shards.  So a round
    crosses a shard boundary once, and one shard settles in one round."""
    edges = _read_shuffled(edge_paths, shard, shards)
    node, neighbor = edges.column("node").to_numpy(), edges.column("neighbor").to_numpy()
    nodes = np.unique(node)
    if previous is None:
        before = nodes
        labels, changed = nodes.copy(), np.ones(len(nodes), dtype=bool)
    else:
        before = read_table(Path(previous) / f"labels-{shard:05d}.arrow").column("label")
        before = before.to_numpy()
        outboxes = [str(Path(previous) / f"outbox-{k:05d}.arrow") for k in range(shards)]
        inbox = _read_shuffled(outboxes, shard, shards)
        labels = before.copy()
        to = np.searchsorted(nodes, inbox.column("node").to_numpy())
        np.minimum.at(labels, to, inbox.column("label").to_numpy())
    source = np.searchsorted(nodes, node)
    inside = neighbor % shards == shard
    root = _local_roots(source[inside], np.searchsorted(nodes, neighbor[inside]), len(nodes))
    lowest = labels.copy()
    np.minimum.at(lowest, root, labels)
    labels = lowest[root]
    if previous is not None:
        changed = labels < before
    send = changed[source] & ~inside
    to, label = neighbor[send], labels[source][send]
    order = np.lexsort((label, to))  # one message per receiver: the smallest label
    to, label = to[order], label[order]
    first = np.ones(len(to), dtype=bool)
    first[1:] = to[1:] != to[:-1]
    to, label = to[first], label[first]
    write_table(
        Path(out_dir) / f"labels-{shard:05d}.arrow",
        pa.table({"node": pa.array(nodes), "label": pa.array(labels)}),
    )
    _write_shuffled(
        Path(out_dir) / f"outbox-{shard:05d}.arrow",
        {"node": pa.array(to), "label": pa.array(label)},
        to % shards,
        shards,
    )
    return {"extra": {"messages": len(to), "relabelled": int((labels < before).sum())}}


def _local_roots(a: np.ndarray, b: np.ndarray, count: int) -> np.ndarray:
    """For each of `count` nodes, the smallest node of its component over the links a-b
    (hook each tree's root to the smallest root it touches, then shortcut: the number of
    trees halves at least every pass)."""
    root = np.arange(count)
    while True:
        ra, rb = root[a], root[b]
        apart = ra != rb
        if not apart.any():
            return root
        low, high = np.minimum(ra[apart], rb[apart]), np.maximum(ra[apart], rb[apart])
        np.minimum.at(root, high, low)
        while True:
            up = root[root]
            if (up == root).all():
                break
            root = up


def component_members(
    labels_dir: str,
    hub_paths: list[str],
    shard: int,
    signature_paths: list[str],
    doc_paths: list[str],
    sources: list[str],
    bands: int,
    out_path: str,
    shards: int,
) -> dict:
    """Step 5: the shard's nodes with what the survivor order and the candidate test need,
    routed by component."""
    labels = read_table(Path(labels_dir) / f"labels-{shard:05d}.arrow")
    nodes, label = labels.column("node").to_numpy(), labels.column("label").to_numpy()
    memberships = _read_shuffled(hub_paths, shard, shards)
    hubs = np.full((len(nodes), bands), -1, dtype=np.int64)
    at = np.searchsorted(nodes, memberships.column("node").to_numpy())
    hubs[at, memberships.column("band").to_numpy()] = memberships.column("hub").to_numpy()
    if sources:
        rank_of = {name: i for i, name in enumerate(sources)}
        rank = [rank_of.get(s, len(sources)) for s in take(doc_paths, nodes, "source")]
    else:
        rank = [0] * len(nodes)
    _write_shuffled(
        out_path,
        {
            "label": pa.array(label),
            "node": pa.array(nodes),
            "rank": pa.array(rank, pa.int32()),
            "length": pa.array(take(signature_paths, nodes, "length"), pa.int64()),
            "doc_id": pa.array(take(signature_paths, nodes, "doc_id"), pa.string()),
            "hubs": pa.FixedSizeListArray.from_arrays(pa.array(hubs.reshape(-1)), bands),
        },
        label % shards,
        shards,
    )
    return {}


# Components one after the other, each in the survivor order: earliest source, longest text,
# smallest doc_id (Arrow compares strings by UTF-8 bytes: the order of Python's str).
SURVIVOR_ORDER = [
    ("label", "ascending"),
    ("rank", "ascending"),
    ("length", "descending"),
    ("doc_id", "ascending"),
]


def component_firsts(
    member_paths: list[str], shard: int, order_path: str, check_path: str, shards: int
) -> dict:
    """Step 6: the shard's components in the survivor order, and each member that is a
    candidate of its component's first document sent with it to the member's node shard."""
    members = _read_shuffled(member_paths, shard, shards)
    members = members.take(pc.sort_indices(members, sort_keys=SURVIVOR_ORDER))
    write_table(Path(order_path), members)
    label, node = members.column("label").to_numpy(), members.column("node").to_numpy()
    hubs = hub_matrix(members)
    start = np.ones(len(label), dtype=bool)
    start[1:] = label[1:] != label[:-1]
    first = np.maximum.accumulate(np.where(start, np.arange(len(label)), 0))
    candidate = ((hubs == hubs[first]) & (hubs >= 0)).any(axis=1) & ~start
    _write_shuffled(
        check_path,
        {
            "label": pa.array(label[candidate]),
            "node": pa.array(node[candidate]),
            "first": pa.array(node[first][candidate]),
        },
        node[candidate] % shards,
        shards,
    )
    return {}
