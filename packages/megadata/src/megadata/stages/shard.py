"""Shard: tokenized partitions -> train/ and valid/ Arrow shards and manifest.json.

The split is by document and deterministic: a document is in valid when the
sha256 of its id falls in 1 of `valid_every` (30: the paper's 29:1) buckets.
Shards hold whole documents, about `shard_tokens` tokens each, in partition
order: a split's shard ends after the partition that brings it to `shard_tokens`.
The manifest, written last and atomically, is what makes a corpus directory
complete; it records each shard's sha256.  The files are written in the corpus format
of `megacommon.corpus_format` (its `write_shard` and `write_manifest`).

The shards are written in parallel, in two rounds of tasks (`write_shards`): each
partition's documents and tokens per split are counted (`count_partition`), the shards
are planned from the counts in this process (`plan_shards`: a few numbers a partition),
and each shard is written by a task of its own (`write_shard`) from the partitions the
plan gives it.  The bytes are those of writing the partitions one after the other.
"""

import hashlib
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc

from megacommon import corpus_format
from megacommon.corpus_format import SPLITS
from megadata.documents import read_table
from megadata.runner import Runner, Task, task_counts
from megadata.settings import PositiveInt


@dataclass(frozen=True)
class ShardSettings:
    """The recipe's `[shard]` section."""

    valid_every: PositiveInt = 30  # 1 in `valid_every` documents in valid/: the paper's 29:1
    shard_tokens: PositiveInt = 1 << 20
    sentence_boundaries: bool | None = None  # keep sentence ends; None: for a BERT corpus


def is_valid_doc(doc_id: str, valid_every: int) -> bool:
    digest = hashlib.sha256(doc_id.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") % valid_every == 0


def _split_rows(table: pa.Table, valid_every: int) -> dict[str, pa.Array]:
    """Each split's mask over the rows of a tokenized partition."""
    ids = table.column("doc_id").to_pylist()
    valid = pa.array([is_valid_doc(d, valid_every) for d in ids], pa.bool_())
    return {"train": pc.invert(valid), "valid": valid}


def count_partition(path: str, valid_every: int) -> dict:
    """A task: the documents and tokens of each split in a tokenized partition."""
    table = read_table(Path(path))
    lengths = pc.list_value_length(table.column("tokens"))
    split = {}
    for name, mask in _split_rows(table, valid_every).items():
        split[name] = [pc.sum(mask).as_py() or 0, pc.sum(lengths.filter(mask)).as_py() or 0]
    return {"docs_in": table.num_rows, "split": split}


def plan_shards(counts: list[dict], shard_tokens: int) -> dict[str, list[list[int]]]:
    """Each split's shards as lists of partition numbers, from each partition's
    {split: [documents, tokens]} (`count_partition`): a shard takes the partitions with
    documents of its split until it holds `shard_tokens`."""
    shards = {s: [] for s in SPLITS}
    pending, tokens = {s: [] for s in SPLITS}, dict.fromkeys(SPLITS, 0)
    for k, c in enumerate(counts):
        for split in SPLITS:
            docs, n = c[split]
            if docs == 0:
                continue
            pending[split].append(k)
            tokens[split] += n
            if tokens[split] >= shard_tokens:
                shards[split].append(pending[split])
                pending[split], tokens[split] = [], 0
    for split in SPLITS:
        if pending[split]:
            shards[split].append(pending[split])
    return shards


def write_shard(parts: list[str], split: str, path: str, valid_every: int) -> dict:
    """A task: the documents of `split` in the partitions, in order, as one shard file."""
    tables = []
    for part in parts:
        table = read_table(Path(part))
        tables.append(table.filter(_split_rows(table, valid_every)[split]))
    shard = corpus_format.write_shard(path, pa.concat_tables(tables).combine_chunks())
    docs = shard["docs"]
    return {"docs_in": docs, "docs_out": docs, "tokens": shard["tokens"], "shard": shard}


def write_shards(
    tokenized: list[str],
    corpus: str,
    valid_every: int,
    shard_tokens: int,
    work: str,
    runner: Runner | None = None,
) -> dict:
    """The shards of the partitions under `<corpus>/train/` and `<corpus>/valid/` (the
    rounds' task markers under `work`): each split's shards and totals, and the rounds'
    wall and CPU seconds."""
    runner = runner or Runner(workers=1, progress=False)
    corpus, work = Path(corpus), Path(work)
    count_tasks = [Task(Path(p).stem, (p, valid_every)) for p in tokenized]
    counted = runner.run("count", work / "count", count_tasks, count_partition)
    counts = [task_counts(work / "count", t.id)["split"] for t in count_tasks]
    plan = plan_shards(counts, shard_tokens)
    write_tasks = []
    for split in SPLITS:
        for i, parts in enumerate(plan[split]):
            path = str(corpus / corpus_format.shard_file(split, i))
            args = ([tokenized[k] for k in parts], split, path, valid_every)
            write_tasks.append(Task(f"{split}-{i:05d}", args))
    written = runner.run("write", work / "write", write_tasks, write_shard)
    shards = {s: [] for s in SPLITS}
    for t in write_tasks:
        split, path = t.args[1], Path(t.args[2])
        shards[split].append(
            {"file": f"{split}/{path.name}", **task_counts(work / "write", t.id)["shard"]}
        )
    totals = {s: {"docs": sum(c[s][0] for c in counts), "tokens": sum(c[s][1] for c in counts)}
              for s in SPLITS}  # fmt: skip
    return {
        "shards": shards,
        "counts": totals,
        "seconds": counted.seconds + written.seconds,
        "cpu_seconds": counted.cpu_seconds + written.cpu_seconds,
        "peak_rss_mb": max(counted.peak_rss_mb, written.peak_rss_mb),
    }
