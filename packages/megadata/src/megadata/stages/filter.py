"""Filter: drop documents shorter than `min_tokens` tokens of the corpus tokenizer (paper: 128).

Counting a document's tokens means encoding it, so the ids (and, for a BERT corpus, the
sentence ends) are kept: `tokens_path` receives them for every document kept, and the
tokenize stage takes them from there instead of encoding the corpus a second time (the
stages between only remove documents, never change a text).
"""

from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa

from megadata.documents import read_table, text_bytes, write_kept, write_table
from megadata.encode import DEFAULT_SPLITTER, token_table


@dataclass(frozen=True)
class FilterSettings:
    """The recipe's `[filter]` section."""

    min_tokens: int = 128  # the paper's


def filter_partition(
    in_path: str,
    out_path: str,
    tokenizer_path: str,
    min_tokens: int,
    tokens_path: str | None = None,
    sentences: bool = False,
    splitter: str = DEFAULT_SPLITTER,
) -> dict:
    table = read_table(Path(in_path))
    docs = table.to_pylist()
    tokens, ends, lengths = token_table(tokenizer_path, docs, sentences, splitter)
    keep = lengths >= min_tokens
    kept = [d for d, k in zip(docs, keep.tolist(), strict=True) if k]
    if tokens_path is not None:
        mask = pa.array(keep, pa.bool_())
        columns = {
            "doc_id": pa.array([d["doc_id"] for d in kept], pa.string()),
            "tokens": tokens.filter(mask),
        }
        if ends is not None:
            columns["sentence_ends"] = ends.filter(mask)
        write_table(Path(tokens_path), pa.table(columns), {"sentences": sentences})
    write_kept(Path(out_path), table, keep)
    return {
        "docs_in": len(docs),
        "docs_out": len(kept),
        "bytes_in": text_bytes(docs),
        "bytes_out": text_bytes(kept),
        "tokens": int(lengths[keep].sum()),
        "extra": {"too_short": len(docs) - len(kept)},
    }
