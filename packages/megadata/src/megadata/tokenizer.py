"""The corpus tokenizer: GPT-2 byte-level BPE or BERT WordPiece, as one HF `tokenizers` file.

A recipe either points at existing files (GPT-2's vocab.json + merges.txt, BERT's
vocab.txt, or any tokenizer.json) or trains one on the cleaned corpus.  Either
way the corpus keeps `tokenizer.json`, whose sha256 the manifest records and
megatrain checks.
"""

import itertools
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, replace
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

from megadata.encode import bert_pieces, gpt2_pieces
from megadata.settings import PositiveNumber, load

EOD_TOKEN = {"gpt2-bpe": "<|endoftext|>", "bert-wordpiece": "[SEP]"}
BERT_SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


DEFAULT_VOCAB_SIZE = 8192  # what a tokenizer is trained to when the recipe names no size


@dataclass(frozen=True)
class TokenizerSettings:
    """The recipe's `[tokenizer]` section: the files of a tokenizer, or what to train."""

    kind: str = "gpt2-bpe"  # or "bert-wordpiece"
    # Trained to DEFAULT_VOCAB_SIZE when None; a loaded tokenizer is checked against it if set.
    vocab_size: int | None = None
    lowercase: bool = True  # WordPiece's normalizer
    train_mb: PositiveNumber | None = None  # learnt from the first MB of cleaned text (all: None)
    # Files (relative to the recipe): GPT-2's vocab.json and merges.txt, BERT's vocab.txt, or
    # a whole tokenizer.json.
    vocab: str | None = None
    merges: str | None = None
    tokenizer_json: str | None = None
    # The token that ends each document (None: the kind's, EOD_TOKEN) and one that starts it
    # (None: none), as the tokenizer defines them: Llama 3's tokenizer.json, say, ends with
    # "<|end_of_text|>" and starts with "<|begin_of_text|>".
    eod_token: str | None = None
    bos_token: str | None = None

    def __post_init__(self):
        _check_kind(self.kind)
        if self.bos_token is not None and self.kind == "bert-wordpiece":
            raise ValueError(
                "tokenizer.bos_token: a bert-wordpiece corpus starts its samples with [CLS] "
                "itself; leave bos_token unset"
            )


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


def _train(kind: str, words: Counter, vocab_size: int, lowercase: bool) -> Tokenizer:
    """A tokenizer learnt from counted words (`count_words`; see `_learn_bpe`)."""
    if kind == "gpt2-bpe":
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=[EOD_TOKEN[kind]],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tok = _learn_bpe(words, trainer)
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        return tok
    tok = _learn_wordpiece(words, vocab_size)
    tok.normalizer = normalizers.BertNormalizer(lowercase=lowercase)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    return tok


def count_words(kind: str, texts: Iterable[str], lowercase: bool = True) -> Counter:
    """The words the tokenizer of `kind` learns from, counted over `texts` (counts of parts
    of a corpus add up to the counts of the whole)."""
    _check_kind(kind)
    return _gpt2_words(texts) if kind == "gpt2-bpe" else _bert_words(texts, lowercase)


def byte_alphabet() -> list[str]:
    """GPT-2's character for each byte value (the ByteLevel pre-tokenizer's spelling)."""
    shown = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    hidden = (b for b in range(256) if b not in shown)
    spelling = {b: chr(b) for b in shown} | {b: chr(256 + i) for i, b in enumerate(hidden)}
    return [spelling[b] for b in range(256)]


def _gpt2_words(texts: Iterable[str]) -> Counter:
    """The words GPT-2's pre-tokenizer makes of `texts`, counted: its regex' pieces (cut
    as megadata.encode cuts them, the same as HF), each spelt in the byte alphabet."""
    pieces = Counter()
    for text in texts:
        pieces.update(gpt2_pieces(text))
    spell = str.maketrans(dict(zip(map(chr, range(256)), byte_alphabet(), strict=True)))
    return Counter({p.encode().decode("latin-1").translate(spell): n for p, n in pieces.items()})


def _bert_words(texts: Iterable[str], lowercase: bool) -> Counter:
    """The words BERT's normalizer and pre-tokenizer make of `texts`, counted: each
    distinct whitespace-separated piece is normalised and split once (neither crosses a
    whitespace boundary: megadata.encode)."""
    pieces = Counter()
    for text in texts:
        pieces.update(bert_pieces(text))
    normalize = normalizers.BertNormalizer(lowercase=lowercase).normalize_str
    split = pre_tokenizers.BertPreTokenizer().pre_tokenize_str
    words = Counter()
    for piece, n in pieces.items():
        for word, _ in split(normalize(piece)):
            words[word] += n
    return words


def _learn_bpe(words: Counter, trainer) -> Tokenizer:
    """BPE learnt from counted words.

    HF's trainer counts the words of every text with the tokenizer's pre-tokenizer, which
    is most of its time (GPT-2's regex runs at about 3 MB/s a core there).  Here the words
    are counted by our pre-tokenizers (2 to 3x faster) and handed over as texts of words
    separated by spaces, each word as often as counted, split by `WhitespaceSplit`: the
    trainer sees the same counts, so it learns the same merges (tested against HF)."""

    def spelled_out(chunk: int = 1 << 20):
        batch, size = [], 0
        for word, n in words.items():
            batch.append(" ".join(itertools.repeat(word, n)))
            size += (len(word) + 1) * n
            if size >= chunk:
                yield " ".join(batch)
                batch, size = [], 0
        if batch:
            yield " ".join(batch)

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()  # no word holds a space
    tok.train_from_iterator(spelled_out(), trainer=trainer)
    return tok


def _learn_wordpiece(words: Counter, vocab_size: int) -> Tokenizer:
    """WordPiece learnt as HF's WordPieceTrainer learns it (BPE over the words' characters,
    a character after the first spelt "##c"), but the same every time.

    HF numbers the "##c" symbols in the order a hash map gives the words, which differs
    from run to run (huggingface/tokenizers#1794), and a merge between pairs of equal count
    goes to the lower numbers: the same corpus gave a different vocabulary on each run.
    Here each character that follows another is spelt as a character of its own (code
    points the words do not use, given in the characters' order) before the BPE trainer sees
    the words, so every symbol is in the sorted alphabet, and is spelt "##c" afterwards."""
    chars = sorted(set().union(*words))
    later = sorted({c for w in words for c in w[1:]})
    used = set(chars)
    spare = (  # low code points first: two bytes of UTF-8 each keep the trainer's input short
        chr(c)
        for c in itertools.chain(range(0x100, 0xD800), range(0xE000, 0x110000))
        if chr(c) not in used and not chr(c).isspace()
    )
    marked = dict(zip(later, spare, strict=False))
    if len(marked) < len(later):
        raise ValueError("the corpus uses too many distinct characters to train WordPiece")
    mark, unmark = str.maketrans(marked), str.maketrans({v: k for k, v in marked.items()})
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=BERT_SPECIALS,
        initial_alphabet=chars,  # every character alone, as HF's alphabet has them
        show_progress=False,
    )
    bpe = _learn_bpe(Counter({w[0] + w[1:].translate(mark): n for w, n in words.items()}), trainer)
    continued = set(marked.values())
    vocab: dict[str, int] = {}
    for token, _ in sorted(bpe.get_vocab().items(), key=lambda kv: kv[1]):
        if token not in BERT_SPECIALS:
            token = ("##" if token[0] in continued else "") + token.translate(unmark)
        vocab.setdefault(token, len(vocab))
    tok = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tok.add_special_tokens(BERT_SPECIALS)
    return tok


def build_tokenizer(
    config: TokenizerSettings, texts: Iterable[str], base: Path, words: Counter | None = None
) -> Tokenizer:
    """The recipe's tokenizer: loaded from the files it names, else trained on `texts`
    (or on `words`, counted already by `count_words`)."""
    config = load(TokenizerSettings, config, "[tokenizer]")
    kind, lowercase = config.kind, config.lowercase

    def path(key):
        if getattr(config, key) is None:
            raise FileNotFoundError(f"tokenizer.{key}: no file given")
        p = Path(getattr(config, key))
        p = p if p.is_absolute() else base / p
        if not p.is_file():
            raise FileNotFoundError(f"tokenizer.{key}: {p} does not exist")
        return p

    if config.tokenizer_json is not None:
        tok = Tokenizer.from_file(str(path("tokenizer_json")))
    elif kind == "gpt2-bpe" and (config.vocab is not None or config.merges is not None):
        tok = _gpt2_from_files(path("vocab"), path("merges"))
    elif kind == "bert-wordpiece" and config.vocab is not None:
        tok = _bert_from_vocab(path("vocab"), lowercase)
    else:
        words = count_words(kind, texts, lowercase) if words is None else words
        tok = _train(
            kind,
            words,
            DEFAULT_VOCAB_SIZE if config.vocab_size is None else config.vocab_size,
            lowercase,
        )
        config = replace(config, vocab_size=None)  # a target for training, met or not
    check_tokenizer(tok, config, where="tokenizer")
    if kind == "bert-wordpiece":
        cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
        tok.post_processor = processors.BertProcessing(("[SEP]", sep), ("[CLS]", cls))
    return tok


def check_tokenizer(tok: Tokenizer, config: TokenizerSettings, where: str) -> None:
    """Refuse a tokenizer without the end-of-document token (or the bos_token asked for) or
    with another vocab size."""
    kind = config.kind
    for field, token in (("eod_token", eod_token(config)), ("bos_token", config.bos_token)):
        if token is not None and tok.token_to_id(token) is None:
            raise ValueError(
                f"{where}: the vocabulary has no {token!r} token, which a {kind} corpus needs "
                f"(tokenizer.{field})"
            )
    want = config.vocab_size
    have = tok.get_vocab_size(with_added_tokens=True)
    if want is not None and int(want) != have:
        raise ValueError(
            f"{where}: the tokenizer has {have} tokens but the recipe says "
            f"tokenizer.vocab_size = {want}; fix the recipe or point it at the right files"
        )


def eod_token(config: TokenizerSettings) -> str:
    """The token that ends each document: the settings' `eod_token`, or the kind's."""
    return config.eod_token or EOD_TOKEN[config.kind]


def eod_id(tok: Tokenizer, config: TokenizerSettings) -> int:
    """The id that ends each document."""
    return tok.token_to_id(eod_token(config))


def bos_id(tok: Tokenizer, config: TokenizerSettings) -> int | None:
    """The id that starts each document, or None."""
    return None if config.bos_token is None else tok.token_to_id(config.bos_token)
