"""Each stage on its own: readers, cleaning, tokenizers, near-duplicate detection, the split."""

import hashlib
import json
import logging
from pathlib import Path

import pytest
from corpus_inputs import wiki_dump

from megadata.documents import read_docs
from megadata.stages import clean, dedup, ingest, shard
from megadata.tokenizer import TokenizerSettings, build_tokenizer, eod_id


def test_text_jsonl_and_bad_lines(tmp_path, caplog):
    txt = tmp_path / "a.txt"
    txt.write_text("First paragraph\nstill first.\n\nSecond one.\n\n\n")
    problems = {}
    assert [d["text"] for d in ingest.read_text(txt, "paragraph", problems)] == [
        "First paragraph\nstill first.",
        "Second one.",
    ]
    assert len(list(ingest.read_text(txt, "line", problems))) == 3
    bad = tmp_path / "b.jsonl"
    bad.write_bytes(
        b'{"text": "good one", "url": "http://x"}\n'
        b"not json\n"
        b'{"title": "no text"}\n'
        b'{"text": "caf\xe9 latin-1 byte"}\n'
    )
    with caplog.at_level(logging.WARNING):
        docs = list(ingest.read_jsonl(bad, problems))
    assert [d["text"] for d in docs] == ["good one"]  # never a copy mangled with U+FFFD
    assert problems == {"bad_json": 1, "no_text": 1, "not_utf8": 1}
    assert f"{bad}:2: not JSON" in caplog.text
    assert f"{bad}:3: no 'text' string field" in caplog.text
    assert f"{bad}:4: not UTF-8" in caplog.text


def test_empty_file_is_counted_not_fatal(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    out = tmp_path / "out"
    counts = ingest.ingest_file("s", "text", {}, str(empty), 0, str(out), 10)
    assert counts["docs_out"] == 0 and counts["extra"] == {"empty_files": 1}
    assert list(read_docs(out / "s-00000-0000.arrow")) == []  # an empty partition, complete


def test_html_article_text_by_newspaper(tmp_path, documents):
    doc = documents[0]
    paragraphs = "".join(f"<p>{p}</p>" for p in doc["text"].split("\n\n"))
    page = tmp_path / "p.html"
    page.write_text(
        f"<html><head><title>{doc['title']}</title></head><body><nav>Home | Login</nav>"
        f"<article>{paragraphs}</article><footer>Copyright</footer></body></html>"
    )
    (got,) = ingest.read_html(page, {})
    assert got["title"] == doc["title"]
    assert doc["text"].split("\n\n")[0][:200] in got["text"]
    assert "Login" not in got["text"] and "Copyright" not in got["text"]


def test_wikipedia_articles_only_markup_stripped(tmp_path, documents):
    dump = tmp_path / "wiki.xml"
    dump.write_text(wiki_dump(documents[:2]))
    docs = list(ingest.read_wikipedia(dump, {}))
    assert [d["title"] for d in docs] == [documents[0]["title"], documents[1]["title"]]
    assert docs[0]["text"].startswith(f"{documents[0]['title']} is documented here.")
    assert "'''" not in docs[0]["text"] and "[[" not in docs[0]["text"]
    assert docs[0]["url"].endswith("curid=100")


def test_clean_fixes_unicode_filters_language_and_joins_lines(tmp_path, documents):
    from megadata.documents import write_docs

    english = documents[1]["text"]
    german = (
        "Die Würde des Menschen ist unantastbar. Sie zu achten und zu schützen ist "
        "Verpflichtung aller staatlichen Gewalt. Das Deutsche Volk bekennt sich darum zu "
        "unverletzlichen und unveräußerlichen Menschenrechten."
    )
    rows = [
        {
            "doc_id": "a",
            "source": "web",
            "text": "The caf\u00c3\u00a9 doesn\u00e2\u20ac\u2122t open. " + english,
        },
        {"doc_id": "b", "source": "web", "text": german},
        {
            "doc_id": "c",
            "source": "stories",
            "text": "A line\nbroken in\nthe middle.\n\nNext " + english,
        },
    ]
    write_docs(tmp_path / "in.arrow", rows)
    options = {"min_english_prob": 0.9, "seed": 0, "join_lines_sources": ["stories"]}
    counts = clean.clean_partition(str(tmp_path / "in.arrow"), str(tmp_path / "out.arrow"), options)
    out = {d["doc_id"]: d["text"] for d in read_docs(tmp_path / "out.arrow")}
    assert counts["extra"]["not_english"] == 1 and "b" not in out
    assert out["a"].startswith("The café doesn't open.")
    assert out["c"].startswith("A line broken in the middle.\n\nNext")
    # langdetect with a fixed seed: the same probability every time.
    assert len({clean.english_probability(english[:300], 0) for _ in range(3)}) == 1


@pytest.mark.parametrize("kind", ["gpt2-bpe", "bert-wordpiece"])
def test_tokenizers_train_and_reload_from_their_files(tmp_path, documents, kind):
    texts = [d["text"] for d in documents]
    tok = build_tokenizer({"kind": kind, "vocab_size": 800}, texts, tmp_path)
    assert eod_id(tok, TokenizerSettings(kind=kind)) is not None
    files = tok.model.save(str(tmp_path))  # vocab.json + merges.txt, or vocab.txt
    config = {"kind": kind, "vocab_size": tok.get_vocab_size()}
    if kind == "gpt2-bpe":
        vocab, merges = sorted(files)[1], sorted(files)[0]
        config |= {"vocab": vocab, "merges": merges}
    else:
        config |= {"vocab": files[0]}
    again = build_tokenizer(config, [], tmp_path)
    sample = texts[3][:500]
    assert again.encode(sample).ids == tok.encode(sample).ids
    with pytest.raises(
        ValueError, match=r"has \d+ tokens but the recipe says tokenizer.vocab_size = 5"
    ):
        build_tokenizer({**config, "vocab_size": 5}, [], tmp_path)
    with pytest.raises(FileNotFoundError, match=r"tokenizer\.vocab: .*nope\.txt does not exist"):
        build_tokenizer({**config, "vocab": "nope.txt"}, [], tmp_path)


def test_bands_give_high_recall_at_the_threshold():
    bands, rows = dedup.choose_bands(0.7, 128)
    assert bands * rows <= 128
    assert 1 - (1 - 0.7**rows) ** bands >= 0.995
    # One more row per band would lose recall at 0.7.
    wider = 128 // (rows + 1)
    assert 1 - (1 - 0.7 ** (rows + 1)) ** wider < 0.995


def test_duplicates_verified_clustered_and_one_survivor(tmp_path, documents):
    from megadata.documents import write_docs

    base = documents[5]["text"]
    words = base.split()
    near = " ".join(w if i % 40 else "edited" for i, w in enumerate(words))  # ~2.5% edited
    far = " ".join(w if i % 3 else "edited" for i, w in enumerate(words))  # 33%: J well < 0.7
    rows = [
        {"doc_id": "x/1", "source": "s", "text": base},
        {"doc_id": "x/2", "source": "s", "text": near},
        {"doc_id": "x/3", "source": "s", "text": base + " And one more sentence at the end."},
        {"doc_id": "x/4", "source": "s", "text": far},
        {"doc_id": "x/5", "source": "s", "text": documents[6]["text"]},
    ]
    write_docs(tmp_path / "p.arrow", rows)
    dedup.signature_partition(str(tmp_path / "p.arrow"), str(tmp_path / "sig.arrow"), 128, 3, 1)
    counts = dedup.find_duplicates(
        [str(tmp_path / "sig.arrow")], [str(tmp_path / "p.arrow")], str(tmp_path), 0.7, 128, 3
    )
    removed = json.loads((tmp_path / "removed.json").read_text())
    assert removed == ["x/1", "x/2"]  # the longest (x/3) survives
    assert counts["extra"]["clusters"] == 1
    (cluster,) = [
        json.loads(line) for line in (tmp_path / "clusters.jsonl").read_text().splitlines()
    ]
    assert cluster["survivor"] == "x/3"
    assert all(m["jaccard"] > 0.7 for m in cluster["removed"])
    truth = dedup.jaccard(dedup.shingles(base), dedup.shingles(far))
    assert truth < 0.5  # a pair below 0.5 is never removed


def test_split_is_by_document_and_about_one_in_thirty():
    ids = [f"src/file#{i}" for i in range(30000)]
    valid = [d for d in ids if shard.is_valid_doc(d, 30)]
    assert abs(len(valid) / len(ids) - 1 / 30) < 0.004
    assert valid == [d for d in ids if shard.is_valid_doc(d, 30)]  # deterministic


def test_shards_are_the_partitions_one_after_the_other_cut_at_shard_tokens(tmp_path):
    """Shards written in parallel (a task each, planned from each partition's counts) hold
    each split's documents in partition order, a shard ending after the partition that
    brings it to shard_tokens."""
    import numpy as np
    import pyarrow as pa

    from megadata.documents import read_table, write_table
    from megadata.runner import Runner

    rng = np.random.default_rng(0)
    parts = []
    for k in range(23):
        docs = 0 if k in (3, 4) else int(rng.integers(1, 40))  # two empty partitions
        ids = [f"s/f#{k}.{i}" for i in range(docs)]
        tokens = [list(range(int(rng.integers(1, 300)))) for _ in ids]
        table = pa.table({"doc_id": pa.array(ids, pa.string()),
                          "tokens": pa.array(tokens, pa.list_(pa.uint16()))})  # fmt: skip
        parts.append(str(tmp_path / f"p{k:03d}.arrow"))
        write_table(Path(parts[-1]), table)
    shard_tokens, valid_every = 3000, 7
    with Runner(workers=1, progress=False) as runner:
        result = shard.write_shards(
            parts, str(tmp_path / "corpus"), valid_every, shard_tokens, str(tmp_path / "w"), runner
        )
    for split in shard.SPLITS:
        chunks = []  # each partition's documents of the split: (doc ids, tokens)
        for p in parts:
            t = read_table(Path(p)).to_pylist()
            rows = [
                r for r in t if shard.is_valid_doc(r["doc_id"], valid_every) == (split == "valid")
            ]
            if rows:
                chunks.append(([r["doc_id"] for r in rows], sum(len(r["tokens"]) for r in rows)))
        shards = result["shards"][split]
        assert len(shards) >= (2 if split == "train" else 1)
        at = 0
        for i, entry in enumerate(shards):
            path = tmp_path / "corpus" / entry["file"]
            table = read_table(path).to_pylist()
            ids = [r["doc_id"] for r in table]
            tokens = sum(len(r["tokens"]) for r in table)
            assert (entry["docs"], entry["tokens"]) == (len(ids), tokens)
            assert entry["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
            taken, held = [], []  # the whole chunks this shard holds, in order; their ids
            while len(held) < len(ids):
                taken.append(chunks[at])
                held += chunks[at][0]
                at += 1
            assert held == ids, (split, i)
            last = i == len(shards) - 1
            assert last or tokens >= shard_tokens > tokens - taken[-1][1], (split, i)
        assert at == len(chunks)  # every document of the split, each once
        assert result["counts"][split] == {"docs": sum(len(c[0]) for c in chunks),
                                           "tokens": sum(c[1] for c in chunks)}  # fmt: skip


def test_bert_corpus_keeps_sentence_boundaries(tmp_path, documents):
    from megadata.documents import read_table, write_docs
    from megadata.stages.tokenize import tokenize_partition

    texts = [d["text"] for d in documents[:4]]
    tok = build_tokenizer({"kind": "bert-wordpiece", "vocab_size": 600}, texts, tmp_path)
    tok.save(str(tmp_path / "tok.json"))
    write_docs(tmp_path / "in.arrow", [{"doc_id": str(i), "text": t} for i, t in enumerate(texts)])
    sep = eod_id(tok, TokenizerSettings(kind="bert-wordpiece"))
    tokenize_partition(
        str(tmp_path / "in.arrow"),
        str(tmp_path / "out.arrow"),
        str(tmp_path / "tok.json"),
        sep,
        True,
    )
    table = read_table(tmp_path / "out.arrow")
    for tokens, ends in zip(
        table.column("tokens").to_pylist(), table.column("sentence_ends").to_pylist(), strict=True
    ):
        assert len(ends) > 1 and ends == sorted(set(ends))
        assert ends[-1] == len(tokens) - 1 and tokens[-1] == sep  # [SEP] ends the document
