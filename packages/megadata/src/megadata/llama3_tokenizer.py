"""Llama 3's tokenizer, from Meta's tiktoken file, as a HF `tokenizers` tokenizer.json.

Meta ships Llama 3's tokenizer as `tokenizer.model` (in the `llama-models` wheel): one line
per token, its bytes in base64 and its rank, 128,000 byte-level BPE tokens, encoded by
`tiktoken` with Llama 3's split pattern (`SPLIT_PATTERN`) and 256 special tokens after the
ranks (`special_tokens()`: <|begin_of_text|> = 128000, <|end_of_text|> = 128001, ...).

`tokenizer_from_ranks` makes the same tokenizer in HF's terms: the vocabulary is the ranks
(each token's bytes spelt in GPT-2's byte alphabet, its id its rank); the merges are
every cut of a token into two tokens, ranked by the token they make, as tiktoken merges
any two neighbouring parts that make a token (`merges_from_ranks`); a piece that is a
token is that token (`ignore_merges`, as tiktoken looks a piece up before merging); the
pieces are cut by a `Split` on the pattern, then spelt by `ByteLevel(use_regex=False)`.
The ids equal tiktoken's (tested on varied text and the sample corpus).  The special
tokens are added tokens: `Tokenizer.encode` finds their text in a string unless
`encode_special_tokens` is set, which megadata's encoder sets (a document's text is text).
"""

import base64
import binascii
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

from megacommon.files import atomic_write_bytes
from megadata.encode import LLAMA3_PIECES
from megadata.tokenizer import byte_alphabet

SPLIT_PATTERN = LLAMA3_PIECES  # the `pat_str` of Meta's tokenizer.py
# Bumped when `convert` would write another file from the same tokenizer.model (a fetched
# tokenizer.json records the version it was converted by).
CONVERSION_VERSION = 1
BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"
SPECIAL_TOKEN_COUNT = 256
# The named special tokens in Meta's order; the rest of the 256 are reserved ones.
_NAMED = (
    BOS_TOKEN,
    EOS_TOKEN,
    "<|reserved_special_token_0|>",
    "<|reserved_special_token_1|>",
    "<|finetune_right_pad_id|>",
    "<|step_id|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eom_id|>",
    "<|eot_id|>",
    "<|python_tag|>",
    "<|image|>",
)


def special_tokens(count: int = SPECIAL_TOKEN_COUNT) -> list[str]:
    """Llama 3's special tokens in id order (the first has the id after the last rank)."""
    reserved = (f"<|reserved_special_token_{2 + i}|>" for i in range(count - len(_NAMED)))
    return [*_NAMED, *reserved][:count]


def read_ranks(path: str | Path) -> dict[bytes, int]:
    """A tiktoken file's ranks: {token bytes: rank}, refused unless they are 0..n-1."""
    ranks: dict[bytes, int] = {}
    for number, line in enumerate(Path(path).read_bytes().splitlines(), 1):
        if not line.strip():
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except (ValueError, binascii.Error) as e:
            raise ValueError(f"{path}:{number}: not a tiktoken line (base64 token, rank)") from e
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError(f"{path}: the ranks are not 0..{len(ranks) - 1}, each once")
    return ranks


def merges_from_ranks(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """Every merge tiktoken may make, in the order of the ranks of the tokens they make.

    tiktoken's BPE merges any two neighbouring parts whose bytes together are a token, the
    lowest rank first: so each way of cutting a token into two tokens is a merge, and the
    ways of one token follow each other, by the ranks of the left part, then the right."""
    merges = []
    for token in sorted(ranks, key=ranks.__getitem__):
        cuts = [(token[:i], token[i:]) for i in range(1, len(token))]
        cuts = [(a, b) for a, b in cuts if a in ranks and b in ranks]
        merges += sorted(cuts, key=lambda ab: (ranks[ab[0]], ranks[ab[1]]))
    return merges


def _spell(data: bytes, alphabet: list[str]) -> str:
    """Bytes as HF's ByteLevel pre-tokenizer spells them (GPT-2's byte alphabet)."""
    return "".join(alphabet[b] for b in data)


def tokenizer_from_ranks(ranks: dict[bytes, int], specials: list[str]) -> Tokenizer:
    """The HF tokenizer that encodes as tiktoken does with these ranks, Llama 3's split
    pattern and `specials` numbered after the ranks."""
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        raise ValueError(f"the ranks lack {len(missing)} single bytes (byte {missing[0]}, ...)")
    alphabet = byte_alphabet()
    vocab = {_spell(token, alphabet): rank for token, rank in ranks.items()}
    merges = [(_spell(a, alphabet), _spell(b, alphabet)) for a, b in merges_from_ranks(ranks)]
    tok = Tokenizer(models.BPE(vocab, merges, ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    for i, s in enumerate(specials):
        if tok.token_to_id(s) != len(ranks) + i:
            raise ValueError(f"{s!r} did not get the id {len(ranks) + i}")
    return tok


def convert(model: str | Path, out: str | Path) -> Tokenizer:
    """Meta's Llama 3 tokenizer.model written as a HF tokenizer.json at `out` (whole or
    not at all)."""
    ranks = read_ranks(model)
    tok = tokenizer_from_ranks(ranks, special_tokens())
    atomic_write_bytes(out, tok.to_str().encode())
    return tok
