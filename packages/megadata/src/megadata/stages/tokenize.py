"""Tokenize: documents -> token ids with the end-of-document id appended.

BERT corpora also keep sentence boundaries (`sentence_ends`: the token offset
after each sentence), found by pysbd, a rule-based splitter that needs no
download at run time.
"""

import functools
from pathlib import Path

import pyarrow as pa
from tokenizers import Tokenizer

from megadata.documents import read_docs, text_bytes, write_table


def token_type(vocab_size: int) -> pa.DataType:
    return pa.uint16() if vocab_size <= 1 << 16 else pa.uint32()


@functools.cache
def _segmenter():
    import pysbd

    return pysbd.Segmenter(language="en", clean=False)


def _sentences(text: str) -> list[str]:
    return [s for s in (p.strip() for p in _segmenter().segment(text)) if s]


def tokenize_partition(
    in_path: str, out_path: str, tokenizer_path: str, eod_id: int, sentences: bool
) -> dict:
    tok = Tokenizer.from_file(tokenizer_path)
    docs = list(read_docs(Path(in_path)))
    ids, tokens, ends = [], [], []
    for doc in docs:
        if sentences:
            pieces = tok.encode_batch(_sentences(doc["text"]), add_special_tokens=False)
            seq, bounds = [], []
            for p in pieces:
                seq += p.ids
                bounds.append(len(seq))
            ends.append(bounds)
        else:
            seq = tok.encode(doc["text"], add_special_tokens=False).ids
        ids.append(doc["doc_id"])
        tokens.append([*seq, eod_id])
    dtype = token_type(tok.get_vocab_size(with_added_tokens=True))
    columns = {"doc_id": pa.array(ids, pa.string()), "tokens": pa.array(tokens, pa.list_(dtype))}
    if sentences:
        columns["sentence_ends"] = pa.array(ends, pa.list_(pa.uint32()))
    write_table(Path(out_path), pa.table(columns))
    return {
        "docs_in": len(docs),
        "docs_out": len(docs),
        "bytes_in": text_bytes(docs),
        "tokens": sum(len(t) for t in tokens),
    }
