"""Llama 3's own tokenizer in megadata (issue 48): Meta's tiktoken file converted to a
tokenizer.json gives tiktoken's ids, through `Tokenizer.encode` and through megadata's
encoder (the filter and tokenize stages' path); a special token written in a document is
text; a corpus built with it is uint32, each document <|begin_of_text|> ... <|end_of_text|>.

The conversion is tested on a small tiktoken file written here; the rest reads the real
tokenizer.model and its conversion, which `python scripts/fetch_llama3_tokenizer.py` (run
by `make test`) fetches from the package index into data/raw/llama3."""

import base64
import json
import random
from pathlib import Path

import pyarrow as pa
import pytest
import tiktoken
from tokenizers import Tokenizer

from megadata import llama3_tokenizer as llama3
from megadata.encode import Encoder, llama3_pieces
from megadata.recipe import load_recipe, run_recipe

FETCHED = Path(__file__).resolve().parents[3] / "data" / "raw" / "llama3"
BOS, EOS = 128000, 128001

VARIED = [
    "The quick brown fox jumps over the lazy dog.",
    "Съешь же ещё этих мягких французских булок, да выпей чаю. ПРИВЕТ, мир!",
    "東京タワーは1958年に完成した。我们今天去公园散步。한국어 문장도 있습니다.",
    "مرحبا بالعالم، هذه جملة عربية. ١٢٣٤٥",
    "नमस्ते दुनिया, यह एक हिंदी वाक्य है। १२३४",
    "Ελληνικά, עברית, ไทย and Ⅻ ² ½",
    "1234567 12 123 1234 12345 123456 9876543210 3.14159 1,000,000 -42 2024-01-01",
    " ".join(str(10**k + k) for k in range(7)) + " " + "".join(map(str, range(1, 8))),
    "two  spaces   three    four\t\ttabs \t mixed\n\n\nnewlines   \n  trailing   ",
    "   leading",
    "trailing   ",
    " ",
    "\n\n",
    "",
    "I'M here. I'm here. don't DON'T They'LL they'll we'VE you'd she'S it's O'Neil 'quoted'",
    "emoji 😀😃 family 👩‍👩‍👧‍👦 flag 🇫🇷 thumbs 👍🏽 heart ❤️ coder 🧑‍💻",
    "Windows line\r\nends\r\n\r\nand a lone\rCR \r\n  \r\n",
    "naïve café Ωmega a\u00a0b\u2028c\u200bd\ufeffe \u3000 x\x0by\x1cz\x85",
    "def f(x):\n    return x**2  # comment\n\n\n",
    "https://example.com/a?b=c&d=e, a.b@c.org, $5.00, 50%, (parens) [brackets] {braces}",
    "\u017f '\u017f, Kelvin \u212a, İstanbul, STRASSE ß, ﬁne",
]
# Documents that write Llama 3's special tokens as text (a chat log, a tokenizer's docs).
WRITTEN_SPECIALS = [
    "A chat turn ends with <|eot_id|> in Llama 3's format.",
    "<|begin_of_text|>starts a document; <|end_of_text|> ends it.",
    "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|><|reserved_special_token_7|>",
]


def _tiktoken(ranks: dict[bytes, int], specials: list[str]) -> tiktoken.Encoding:
    numbered = {s: len(ranks) + i for i, s in enumerate(specials)}
    return tiktoken.Encoding(
        "llama3-test",
        pat_str=llama3.SPLIT_PATTERN,
        mergeable_ranks=ranks,
        special_tokens=numbered,
    )


def _as_text(enc: tiktoken.Encoding, texts: list[str]) -> list[list[int]]:
    return [enc.encode(t, disallowed_special=()) for t in texts]


def _write_tiktoken(path: Path, tokens: list[bytes]) -> dict[bytes, int]:
    path.write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for r, t in enumerate(tokens)))
    return dict(zip(tokens, range(len(tokens)), strict=True))


def test_a_small_tiktoken_file_converts_to_tiktokens_ids(tmp_path):
    """Every byte, then tokens that make the conversion work: "abc" made from "ab" + "c"
    or "a" + "bc" (tiktoken merges whichever meets first), ".:.:" which the merges of its
    bytes never reach (":." ranks first) but a piece of exactly ".:.:" is, and a token
    that a piece is whole ("hello") though a lower merge would cut it."""
    order = list(range(256))
    random.Random(0).shuffle(order)  # single bytes need not be the first ranks
    words = [b"ab", b"bc", b"abc", b":.", b".:", b".:.:", b"he", b"ll", b"hell", b"lo"]
    words += [b"hello", b" w", b"or", b" wor", b" world", b"  ", b"   ", b"12", b"123"]
    words += ["é".encode(), "é!".encode(), b"'s", b"\r\n", b"\n\n"]
    ranks = _write_tiktoken(tmp_path / "tokenizer.model", [bytes([b]) for b in order] + words)
    assert llama3.read_ranks(tmp_path / "tokenizer.model") == ranks
    merges = llama3.merges_from_ranks(ranks)
    assert abs(merges.index((b"ab", b"c")) - merges.index((b"a", b"bc"))) == 1  # both cuts
    specials = llama3.special_tokens(4)
    tok = llama3.tokenizer_from_ranks(ranks, specials)
    assert [tok.token_to_id(s) for s in specials] == [len(ranks) + i for i in range(4)]
    tok.save(str(tmp_path / "tokenizer.json"))

    rng = random.Random(1)
    bits = ["a", "b", "c", "h", "e", "l", "o", " ", "w", "r", ":", ".", "1", "2", "3", "é"]
    bits += ["!", "\n", "\r\n", "'", "S", "s", "d", "ab", "bc", ".:", "hello", "<|eot_id|>"]
    texts = ["abc", "ab c", ".:.:", ".:.:.", "hello", " world", "hello world", "1234567"]
    texts += ["".join(rng.choices(bits, k=rng.randint(0, 25))) for _ in range(3000)]
    expected = _as_text(_tiktoken(ranks, specials), texts)
    assert [e.ids for e in tok.encode_batch(texts, add_special_tokens=False)][:8] == expected[:8]
    tok.encode_special_tokens = True
    assert [e.ids for e in tok.encode_batch(texts, add_special_tokens=False)] == expected
    enc = Encoder(str(tmp_path / "tokenizer.json"))
    assert enc.pieces is llama3_pieces  # the fast path: Llama 3's pieces, each encoded once
    assert enc.encode_many(texts) == expected
    assert [tok.decode(ids) for ids in expected] == texts


def test_a_file_that_is_not_byte_level_bpe_is_refused(tmp_path):
    path = tmp_path / "tokenizer.model"
    path.write_text("YQ== 0\nnot-base64! 1\n")
    with pytest.raises(ValueError, match=r"tokenizer.model:2: not a tiktoken line"):
        llama3.read_ranks(path)
    path.write_text("YQ== 0\nYg== 2\n")
    with pytest.raises(ValueError, match=r"the ranks are not 0..1"):
        llama3.read_ranks(path)
    with pytest.raises(ValueError, match=r"lack 254 single bytes"):
        llama3.tokenizer_from_ranks({b"a": 0, b"b": 1}, [])


def _fetched(name: str) -> Path:
    path = FETCHED / name
    if not path.is_file():
        pytest.skip(
            f"{path} is missing: `python scripts/fetch_llama3_tokenizer.py` fetches Llama 3's "
            "tokenizer from the package index (`make test` runs it)"
        )
    return path


@pytest.fixture(scope="module")
def meta():
    """tiktoken over Meta's tokenizer.model, as Meta's own loader builds it."""
    ranks = llama3.read_ranks(_fetched("tokenizer.model"))
    assert len(ranks) == 128_000
    return _tiktoken(ranks, llama3.special_tokens())


@pytest.fixture(scope="module")
def converted() -> Path:
    return _fetched("tokenizer.json")


@pytest.fixture(scope="module")
def encoder(converted) -> Encoder:
    return Encoder(str(converted))


def test_llama3_ids_equal_tiktokens_on_varied_text(meta, converted, encoder, documents):
    texts = VARIED + [d["text"] for d in documents]
    expected = _as_text(meta, texts)
    tok = Tokenizer.from_file(str(converted))
    assert tok.get_vocab_size(with_added_tokens=True) == 128_256
    assert [e.ids for e in tok.encode_batch(texts, add_special_tokens=False)] == expected
    enc = encoder
    assert enc.pieces is llama3_pieces
    assert enc.encode_many(texts) == expected
    assert enc.encode_many(texts) == expected  # from the remembered pieces too
    assert [tok.decode(ids) for ids in expected] == texts
    assert tok.encode("Hello world", add_special_tokens=False).ids == [9906, 1917]


def test_special_tokens_written_in_a_document_are_text(meta, encoder):
    expected = _as_text(meta, WRITTEN_SPECIALS)
    assert all(i < 128_000 for ids in expected for i in ids)
    assert encoder.encode_many(WRITTEN_SPECIALS) == expected
    # HF's own encode would find them (which is why megadata's encoder does not let it).
    plain = Tokenizer.from_str(encoder.tok.to_str()).encode(WRITTEN_SPECIALS[0]).ids
    assert 128009 in plain and meta.encode("<|eot_id|>", allowed_special="all") == [128009]


def test_a_llama3_corpus_is_uint32_and_framed_as_llama3_frames_documents(
    tmp_path, meta, converted, documents
):
    docs = [d["text"] for d in documents[:12]]
    docs[3] += "\n\nIn a chat log, <|eot_id|> ends a turn and <|end_of_text|> a document."
    docs[5] = "<|begin_of_text|> is how Llama 3 starts a document.\n\n" + docs[5]
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
    settings = {
        "kind": "gpt2-bpe",
        "tokenizer_json": str(converted),
        "vocab_size": 128256,
        "eod_token": "<|end_of_text|>",
        "bos_token": "<|begin_of_text|>",
    }
    (tmp_path / "r.toml").write_text(
        'name = "llama3-test"\noutput = "corpus"\npartition_docs = 5\n'
        '[[sources]]\nname = "docs"\nkind = "jsonl"\npaths = ["docs.jsonl"]\n'
        "[clean]\nmin_english_prob = 0.5\n[filter]\nmin_tokens = 8\n"
        "[tokenizer]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in settings.items())
    )
    recipe = load_recipe(tmp_path / "r.toml")
    run_recipe(recipe, workers=1, progress=False)
    manifest = json.loads((recipe.output / "manifest.json").read_text())
    assert manifest["token_dtype"] == "uint32"
    assert (manifest["tokenizer"]["bos_id"], manifest["tokenizer"]["eod_id"]) == (BOS, EOS)
    rows = {}
    for split in manifest["splits"].values():
        for entry in split["shards"]:
            table = pa.ipc.open_file(pa.memory_map(str(recipe.output / entry["file"]))).read_all()
            assert table.schema.field("tokens").type == pa.list_(pa.uint32())
            ids = table.column("doc_id").to_pylist()
            rows |= dict(zip(ids, table.column("tokens").to_pylist(), strict=True))
    assert len(rows) == len(docs)  # every document kept (distinct, English, long enough)
    for doc_id, ids in rows.items():
        text = docs[int(doc_id.rsplit("#", 1)[1])]
        assert ids == [BOS, *meta.encode(text, disallowed_special=()), EOS]
    tok = Tokenizer.from_file(str(recipe.output / "tokenizer.json"))
    assert tok.decode(rows["docs/docs.jsonl#3"][1:-1]) == docs[3]
    assert tok.decode(rows["docs/docs.jsonl#5"], skip_special_tokens=False) == (
        f"<|begin_of_text|>{docs[5]}<|end_of_text|>"
    )
