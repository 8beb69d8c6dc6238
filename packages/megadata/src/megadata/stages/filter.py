"""Filter: drop documents shorter than `min_tokens` tokens of the corpus tokenizer (paper: 128)."""

from pathlib import Path

from tokenizers import Tokenizer

from megadata.documents import read_docs, text_bytes, write_docs


def filter_partition(in_path: str, out_path: str, tokenizer_path: str, min_tokens: int) -> dict:
    tok = Tokenizer.from_file(tokenizer_path)
    docs = list(read_docs(Path(in_path)))
    lengths = [
        len(e.ids) for e in tok.encode_batch([d["text"] for d in docs], add_special_tokens=False)
    ]
    kept = [d for d, n in zip(docs, lengths, strict=True) if n >= min_tokens]
    write_docs(Path(out_path), kept)
    return {
        "docs_in": len(docs),
        "docs_out": len(kept),
        "bytes_in": text_bytes(docs),
        "bytes_out": text_bytes(kept),
        "tokens": sum(n for n in lengths if n >= min_tokens),
        "extra": {"too_short": len(docs) - len(kept)},
    }
