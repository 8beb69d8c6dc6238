"""Corpora in megadata's format, written directly, for the tests of megatrain and megaeval
(megatrain reads files, not megadata)."""

import hashlib
import json
from pathlib import Path

import pyarrow as pa

EOD = 0
VOCAB = 1000
TOKENIZER_SHA = "ab" * 32


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def write_corpus(
    root: Path,
    splits: dict[str, list[list[list[int]]]],
    *,
    dtype: str = "uint16",
    kind: str = "gpt2-bpe",
    batch_rows: int = 3,
    vocab_size: int = VOCAB,
    **manifest_overrides,
) -> Path:
    """A corpus directory in megadata's format: splits -> shards -> documents (token lists)."""
    root.mkdir(parents=True, exist_ok=True)
    value_type = {"uint16": pa.uint16(), "uint32": pa.uint32()}[dtype]
    schema = pa.schema([("doc_id", pa.string()), ("tokens", pa.list_(value_type))])
    entries = {}
    for split, shards in splits.items():
        (root / split).mkdir(exist_ok=True)
        listed = []
        for i, docs in enumerate(shards):
            file = f"{split}/shard-{i:05d}.arrow"
            table = pa.table(
                {"doc_id": [f"{split}-{i}-{r}" for r in range(len(docs))], "tokens": docs},
                schema=schema,
            )
            with pa.ipc.new_file(str(root / file), schema) as writer:
                # Several record batches per shard, as megadata writes large shards.
                for batch in table.to_batches(max_chunksize=batch_rows):
                    writer.write_batch(batch)
            listed.append(
                {
                    "docs": len(docs),
                    "file": file,
                    "sha256": sha256(root / file),
                    "tokens": sum(map(len, docs)),
                }
            )
        entries[split] = {
            "docs": sum(s["docs"] for s in listed),
            "tokens": sum(s["tokens"] for s in listed),
            "shards": listed,
        }
    manifest = {
        "format_version": 1,
        "sentence_boundaries": False,
        "token_dtype": dtype,
        "tokenizer": {
            "eod_id": EOD,
            "file": "tokenizer.json",
            "kind": kind,
            "sha256": TOKENIZER_SHA,
            "vocab_size": vocab_size,
        },
        "splits": entries,
        **manifest_overrides,
    }
    (root / "manifest.json").write_text(json.dumps(manifest))
    return root


def random_documents(rng, count: int, vocab_size: int, low: int, high: int) -> list[list[int]]:
    """`count` documents of random ids in [1, vocab_size), between low and high tokens, + EOD."""
    return [
        [*rng.integers(1, vocab_size, rng.integers(low, high)).tolist(), EOD] for _ in range(count)
    ]


def write_text_corpus(root: Path, texts: list[str], vocab_size: int = 300, valid_every: int = 5):
    """A corpus of real text with a real byte-level BPE tokenizer.json (EOD = "<|endoftext|>")
    trained on it, for tests that encode and decode: (root, tokenizer)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer)
    eod = tok.token_to_id("<|endoftext|>")
    docs = [[*tok.encode(t).ids, eod] for t in texts]
    splits = {
        "train": [[d for i, d in enumerate(docs) if i % valid_every]],
        "valid": [[d for i, d in enumerate(docs) if not i % valid_every]],
    }
    root.mkdir(parents=True, exist_ok=True)
    tok.save(str(root / "tokenizer.json"))
    size = tok.get_vocab_size(with_added_tokens=True)
    write_corpus(root, splits, vocab_size=size)
    manifest = json.loads((root / "manifest.json").read_text())
    manifest["tokenizer"].update(eod_id=eod, sha256=sha256(root / "tokenizer.json"))
    (root / "manifest.json").write_text(json.dumps(manifest))
    return root, tok


def grammar_texts(n: int, seed: int = 0) -> list[str]:
    """Documents of a small grammar ("the cat sat on the mat."), so a tiny model learns
    something in a few steps."""
    import numpy as np

    rng = np.random.default_rng(seed)
    verbs = {"cat": "sat", "dog": "ran", "bird": "flew"}
    out = []
    for _ in range(n):
        sentences = []
        for _ in range(rng.integers(3, 7)):
            subject = str(rng.choice(list(verbs)))
            place = rng.choice(["mat", "tree", "roof"])
            sentences.append(f"the {subject} {verbs[subject]} on the {place}.")
        out.append(" ".join(sentences))
    return out
