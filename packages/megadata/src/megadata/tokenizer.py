"""The corpus tokenizer: GPT-2 byte-level BPE or BERT WordPiece, as one HF `tokenizers` file.

A recipe either points at existing files (GPT-2's vocab.json + merges.txt, BERT's
vocab.txt, or any tokenizer.json) or trains one on the cleaned corpus.  Either
way the corpus keeps `tokenizer.json`, whose sha256 the manifest records and
megatrain checks.
"""

import hashlib
from collections.abc import Iterable
from pathlib import Path

from tokenizers import (
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)

EOD_TOKEN = {"gpt2-bpe": "<|endoftext|>", "bert-wordpiece": "[SEP]"}
BERT_SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def _check_kind(kind: str) -> None:
    if kind not in EOD_TOKEN:
        raise ValueError(f"tokenizer.kind must be one of {sorted(EOD_TOKEN)}, got {kind!r}")


def _gpt2_from_files(vocab: Path, merges: Path) -> Tokenizer:
    tok = Tokenizer(models.BPE.from_file(str(vocab), str(merges)))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def _bert_from_vocab(vocab: Path, lowercase: bool) -> Tokenizer:
    tok = Tokenizer(models.WordPiece.from_file(str(vocab), unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=lowercase)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    return tok


def _train(kind: str, texts: Iterable[str], vocab_size: int, lowercase: bool) -> Tokenizer:
    if kind == "gpt2-bpe":
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=[EOD_TOKEN[kind]],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
    else:
        tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
        tok.normalizer = normalizers.BertNormalizer(lowercase=lowercase)
        tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        tok.decoder = decoders.WordPiece()
        trainer = trainers.WordPieceTrainer(
            vocab_size=vocab_size, special_tokens=BERT_SPECIALS, show_progress=False
        )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def build_tokenizer(config: dict, texts: Iterable[str], base: Path) -> Tokenizer:
    """The recipe's tokenizer: loaded from the files it names, else trained on `texts`."""
    kind = config.get("kind", "gpt2-bpe")
    _check_kind(kind)
    lowercase = bool(config.get("lowercase", True))

    def path(key):
        p = Path(config[key])
        p = p if p.is_absolute() else base / p
        if not p.is_file():
            raise FileNotFoundError(f"tokenizer.{key}: {p} does not exist")
        return p

    if "tokenizer_json" in config:
        tok = Tokenizer.from_file(str(path("tokenizer_json")))
    elif kind == "gpt2-bpe" and ("vocab" in config or "merges" in config):
        tok = _gpt2_from_files(path("vocab"), path("merges"))
    elif kind == "bert-wordpiece" and "vocab" in config:
        tok = _bert_from_vocab(path("vocab"), lowercase)
    else:
        tok = _train(kind, texts, int(config.get("vocab_size", 8192)), lowercase)
        config = {**config, "vocab_size": None}  # a target for training, met or not
    check_tokenizer(tok, config, where="tokenizer")
    if kind == "bert-wordpiece":
        cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
        tok.post_processor = processors.BertProcessing(("[SEP]", sep), ("[CLS]", cls))
    return tok


def check_tokenizer(tok: Tokenizer, config: dict, where: str) -> None:
    """Refuse a tokenizer without the end-of-document token or with another vocab size."""
    kind = config.get("kind", "gpt2-bpe")
    eod = EOD_TOKEN[kind]
    if tok.token_to_id(eod) is None:
        raise ValueError(
            f"{where}: the vocabulary has no {eod!r} token, which a {kind} corpus needs"
        )
    want = config.get("vocab_size")
    have = tok.get_vocab_size(with_added_tokens=True)
    if want is not None and int(want) != have:
        raise ValueError(
            f"{where}: the tokenizer has {have} tokens but the recipe says "
            f"tokenizer.vocab_size = {want}; fix the recipe or point it at the right files"
        )


def eod_id(tok: Tokenizer, kind: str) -> int:
    return tok.token_to_id(EOD_TOKEN[kind])


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
