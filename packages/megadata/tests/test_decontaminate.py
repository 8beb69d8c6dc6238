"""Bloom filter, 8-gram overlap, and a recipe with the holdout and decontaminate stages."""

import hashlib
import inspect
import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pyarrow as pa
import pytest
from click.testing import CliRunner
from corpus_inputs import write_inputs, write_recipe

from megadata.bloom import BloomFileError, BloomFilter, bloom_size
from megadata.cli import main
from megadata.documents import read_docs
from megadata.recipe import RecipeError, load_recipe, run_recipe, run_stage
from megadata.runner import Runner
from megadata.stages.decontaminate import read_eval_set, set_overlap, word_ngrams
from megadata.wikitext_format import format_article, format_articles

# ---------------------------------------------------------------------------- Bloom filter


def test_size_follows_the_formula():
    m, k = bloom_size(100_000, 1e-3)
    assert m == math.ceil(-100_000 * math.log(1e-3) / math.log(2) ** 2)
    assert k == round(m / 100_000 * math.log(2)) == 10
    with pytest.raises(ValueError, match="false-positive rate"):
        bloom_size(10, 1.5)


def test_no_false_negatives_and_the_target_false_positive_rate():
    bloom = BloomFilter(100_000, fpr=1e-3, seed=7)
    bloom.add_many(f"key {i}" for i in range(100_000))
    assert bloom.contains_many(f"key {i}" for i in range(100_000)).all()
    assert "key 5" in bloom and b"key 5" in bloom
    measured = bloom.contains_many(f"other {i}" for i in range(100_000)).mean()
    assert 0.0005 < measured < 0.002, measured  # 1e-3 expected: about 100 of 100,000


_BUILD_IN_ANOTHER_PROCESS = textwrap.dedent(
    """
    import sys
    from megadata.bloom import BloomFilter
    bloom = BloomFilter(5000, fpr=1e-3, seed=3)
    bloom.add_many(f"eight word gram number {i} of the test" for i in range(5000))
    bloom.save(sys.argv[1])
    """
)


def test_same_bits_in_another_process(tmp_path):
    bloom = BloomFilter(5000, fpr=1e-3, seed=3)
    bloom.add_many(f"eight word gram number {i} of the test" for i in range(5000))
    bloom.save(tmp_path / "here.bloom")
    env = {**os.environ, "PYTHONHASHSEED": "12345"}  # Python's own hash() would differ
    subprocess.run(
        [sys.executable, "-c", _BUILD_IN_ANOTHER_PROCESS, str(tmp_path / "there.bloom")],
        check=True,
        env=env,
    )
    assert (tmp_path / "there.bloom").read_bytes() == (tmp_path / "here.bloom").read_bytes()
    other_seed = BloomFilter(5000, fpr=1e-3, seed=4)
    other_seed.add_many(f"eight word gram number {i} of the test" for i in range(5000))
    assert (other_seed.bits != bloom.bits).any()


def test_save_load_round_trip_and_damaged_files_are_refused(tmp_path):
    bloom = BloomFilter(1000, fpr=0.01, seed=1, meta={"ngram": 8})
    bloom.add_many(["alpha", "beta", "gamma"])
    path = tmp_path / "f.bloom"
    bloom.save(path)
    loaded = BloomFilter.load(path)
    assert loaded.header() == bloom.header() and loaded.added == 3
    assert (loaded.bits == bloom.bits).all()
    assert loaded.contains_many(["alpha", "beta", "gamma"]).all() and "delta" not in loaded
    loaded.add("delta")  # the loaded bits are writable
    assert "delta" in loaded

    data = path.read_bytes()
    (tmp_path / "short.bloom").write_bytes(data[:-10])
    with pytest.raises(BloomFileError, match=r"short\.bloom: truncated or damaged"):
        BloomFilter.load(tmp_path / "short.bloom")
    v2 = data.replace(b'"format_version": 1', b'"format_version": 2')
    (tmp_path / "v2.bloom").write_bytes(v2)
    with pytest.raises(BloomFileError, match=r"v2\.bloom: Bloom filter format version 2"):
        BloomFilter.load(tmp_path / "v2.bloom")
    (tmp_path / "other.bloom").write_bytes(b"not a filter at all")
    with pytest.raises(BloomFileError, match=r"other\.bloom: not a megadata Bloom filter"):
        BloomFilter.load(tmp_path / "other.bloom")


# ---------------------------------------------------------------------------- 8-grams


def test_ngrams_are_the_same_for_plain_and_wikitext_text():
    plain = "A well-known test, of 1,000.5 words: it's the eighth one here."
    wikitext = format_article("T", plain).splitlines()[3]
    assert "@-@" in wikitext and "@,@" in wikitext and "@.@" in wikitext
    assert word_ngrams(plain) == word_ngrams(wikitext)
    assert word_ngrams("one two three four five six seven") == set()
    assert word_ngrams("One two three four five six seven eight") == {
        "one two three four five six seven eight"
    }


def test_overlap_percentages_of_hand_made_texts():
    train = "one two three four five six seven eight nine ten"  # 3 distinct 8-grams
    bloom = BloomFilter(100, fpr=1e-3)
    bloom.add_many(word_ngrams(train))

    def percent(*texts):
        return set_overlap(bloom, [{"text": t} for t in texts], 8)

    # 3 distinct 8-grams, 2 in training
    assert percent("One, two: three four five six seven eight nine! eleven") == {
        "units": 1, "ngrams": 3, "found": 2, "overlap_percent": 66.67
    }  # fmt: skip
    # 4 distinct: the 3 of the training text and one more; a repeat counts once
    got = percent(train, train + " twelve")
    assert (got["ngrams"], got["found"], got["overlap_percent"]) == (4, 3, 75.0)
    got = percent("alpha beta gamma delta epsilon zeta eta theta iota kappa")
    assert (got["ngrams"], got["found"], got["overlap_percent"]) == (3, 0, 0.0)
    assert percent("too short")["overlap_percent"] is None


def test_max_doc_overlap_removes_documents_mostly_made_of_eval_text(tmp_path, documents):
    from megadata.documents import read_meta, write_docs
    from megadata.stages import decontaminate

    (tmp_path / "eval.txt").write_text(documents[0]["text"])
    sets = [{"name": "e", "kind": "text", "path": str(tmp_path / "eval.txt")}]
    cfg = decontaminate.settings({"max_doc_overlap": 0.5})
    decontaminate.prepare_eval_sets(sets, str(tmp_path), cfg)
    half = documents[0]["text"].split()
    docs = [
        {"doc_id": "mostly-eval", "title": "", "text": " ".join(half[: len(half) * 3 // 4])},
        {"doc_id": "other", "title": "", "text": documents[1]["text"]},
    ]
    write_docs(tmp_path / "in.arrow", docs)
    counts = decontaminate.remove_partition(
        str(tmp_path / "in.arrow"), str(tmp_path / "out.arrow"), str(tmp_path), cfg
    )
    assert [d["doc_id"] for d in read_docs(tmp_path / "out.arrow")] == ["other"]
    (removed,) = read_meta(tmp_path / "out.arrow")["removed"]
    assert removed["doc_id"] == "mostly-eval" and removed["reason"] == "doc_overlap"
    assert removed["overlap"] == 1.0 and counts["extra"]["removed_doc_overlap"] == 1
    # Off by default: the same document stays.
    off = decontaminate.settings({})
    decontaminate.prepare_eval_sets(sets, str(tmp_path / "off"), off)
    decontaminate.remove_partition(
        str(tmp_path / "in.arrow"), str(tmp_path / "off.arrow"), str(tmp_path / "off"), off
    )
    assert len(list(read_docs(tmp_path / "off.arrow"))) == 2


# ---------------------------------------------------------------------------- the recipe


def _unrelated_docs() -> list[str]:
    """Real English that the test corpus (docstrings of other modules) does not hold."""
    import json as json_module
    import shutil

    return [inspect.getdoc(f) for f in (json_module.dumps, json_module.loads, shutil.copytree)]


def _decontaminate_section(sets: list[dict], **settings) -> str:
    rows = ",\n".join(
        "  { " + ", ".join(f"{k} = {json.dumps(v)}" for k, v in s.items()) + " }" for s in sets
    )
    lines = [f"{k} = {json.dumps(v)}" for k, v in settings.items()]
    return (
        "\n[decontaminate]\n"
        + "".join(line + "\n" for line in lines)
        + (f"eval_sets = [\n{rows},\n]\n")
    )


EVAL_SETS = [
    {"name": "planted", "kind": "wikitext", "path": "eval/planted.tokens"},
    {"name": "copied", "kind": "text", "path": "eval/copied.txt"},
    {"name": "unrelated", "kind": "text", "path": "eval/unrelated.txt"},
    {"name": "empty", "kind": "lambada", "path": "eval/empty.jsonl"},
    {"name": "heldout-wiki", "kind": "wikitext", "path": "@holdout/wiki.test.tokens"},
    {"name": "heldout-lambada", "kind": "lambada", "path": "@holdout/lambada.jsonl"},
]


def _write_recipe(root: Path, inputs: dict, documents: list[dict], output: Path) -> Path:
    """The test recipe with [holdout] (1 in 3 of the `notes` source) and [decontaminate].

    The jsonl source holds documents[0:14] with their titles as doc ids pydocs/docs.jsonl#i.
    Planted in the WikiText eval set: documents[2] (same title, same text: removed),
    documents[9]'s text under another title (removed for content alone), and
    documents[5]'s title over unrelated text (kept).
    """
    unrelated = _unrelated_docs()
    (root / "eval").mkdir(parents=True, exist_ok=True)
    (root / "eval" / "planted.tokens").write_text(
        format_articles(
            [
                (documents[2]["title"], documents[2]["text"]),
                ("Tropical Storm Kirk (2000)", documents[9]["text"]),
                (documents[5]["title"], unrelated[0]),
            ]
        )
    )
    (root / "eval" / "copied.txt").write_text(documents[8]["text"])
    (root / "eval" / "unrelated.txt").write_text("\n\n".join(unrelated[1:]))
    (root / "eval" / "empty.jsonl").write_text("")
    path = write_recipe(root / "r.toml", inputs, output, holdout={"every": 3, "sources": ["notes"]})
    # The reusable training filter too, in 3 shards built by their own tasks.
    section = _decontaminate_section(EVAL_SETS, train_bloom=True, bloom_shards=3)
    path.write_text(path.read_text() + section)
    return path


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, documents):
    return write_inputs(tmp_path_factory.mktemp("inputs"), documents)


@pytest.fixture(scope="module")
def built(tmp_path_factory, inputs, documents):
    root = tmp_path_factory.mktemp("decon")
    recipe = load_recipe(_write_recipe(root, inputs, documents, root / "corpus"))
    return recipe, run_recipe(recipe, workers=1, progress=False)


def _shard_ids(corpus: Path) -> list[str]:
    ids = []
    for path in sorted(corpus.glob("*/shard-*.arrow")):
        ids += pa.ipc.open_file(pa.memory_map(str(path))).read_all().column("doc_id").to_pylist()
    return ids


def test_stages_in_order_and_the_manifest_lists_them(built):
    recipe, results = built
    assert [r.stage for r in results] == [
        "ingest", "clean", "tokenizer", "filter", "dedup", "holdout", "decontaminate",
        "tokenize", "shard",
    ]  # fmt: skip
    manifest = json.loads((recipe.output / "manifest.json").read_text())
    assert [s["stage"] for s in manifest["stages"]] == [r.stage for r in results[:-1]]
    dedup, held, decon, tokenize = results[4], results[5], results[6], results[7]
    assert held.docs_in == dedup.docs_out
    assert held.docs_out == dedup.docs_out - held.extra["held_out"] > 0
    assert decon.docs_in == held.docs_out and decon.docs_out == decon.docs_in - 2
    assert tokenize.docs_in == decon.docs_out == len(_shard_ids(recipe.output))


def test_planted_test_article_removed_by_title_and_content(built, documents):
    recipe, _ = built
    report = json.loads((recipe.output / "reports" / "decontamination.json").read_text())
    removed = {r["doc_id"]: r for r in report["removed"]}
    assert set(removed) == {"pydocs/docs.jsonl#2", "pydocs/docs.jsonl#9"}
    by_title = removed["pydocs/docs.jsonl#2"]
    assert by_title["reason"] == "title+content" and by_title["set"] == "planted"
    assert by_title["title"] == documents[2]["title"] and by_title["overlap"] > 0.95
    by_content = removed["pydocs/docs.jsonl#9"]
    assert by_content["reason"] == "content"
    assert by_content["article"] == "Tropical Storm Kirk ( 2000 )"
    assert report["counts"]["removed"] == {"title+content": 1, "content": 1}
    # Same title as documents[5] but other content: kept, and in the shards.
    shard_ids = set(_shard_ids(recipe.output))
    assert "pydocs/docs.jsonl#5" in shard_ids
    assert not {"pydocs/docs.jsonl#2", "pydocs/docs.jsonl#9"} & shard_ids


def test_overlap_of_copied_unrelated_empty_and_heldout_sets(built):
    recipe, _ = built
    root = recipe.path.parent
    report = json.loads((recipe.output / "reports" / "decontamination.json").read_text())
    sets = {s["name"]: s for s in report["eval_sets"]}
    assert sets["copied"]["overlap_percent"] == 100.0 and sets["copied"]["ngrams"] > 150
    assert sets["unrelated"]["overlap_percent"] < 1.0 and sets["unrelated"]["ngrams"] > 400
    assert sets["empty"]["overlap_percent"] is None and "n/a" in sets["empty"]["note"]
    assert report["counts"]["empty_eval_sets"] == 1
    # Measured after removal: the planted articles' text is no longer in training.
    assert sets["planted"]["overlap_percent"] < 5.0
    # The held-out documents are not in training, but docstrings of one module repeat each
    # other (doctest.testfile shares half its text with testmod): low, not zero.
    for name in ("heldout-wiki", "heldout-lambada"):
        assert sets[name]["ngrams"] > 100 and sets[name]["overlap_percent"] < 25.0, sets[name]
    bloom_dir = recipe.output / "reports" / "train_8grams"
    shards = [BloomFilter.load(p) for p in sorted(bloom_dir.glob("*.bloom"))]
    assert [(b.meta["shard"], b.meta["shards"], b.meta["ngram"]) for b in shards] == [
        (k, 3, 8) for k in range(3)
    ]
    assert report["train"]["shards"] == 3 and report["train"]["bloom"] == "train_8grams/"
    assert sum(b.added for b in shards) == report["train"]["added"]
    # The exact counts are the exact ones; the filter's exceed them by its false positives.
    train = set()
    for part in (recipe.work / "decontaminate").glob("*.arrow"):
        for doc in read_docs(part):
            train |= word_ngrams(doc["text"])
    assert report["train"]["added"] >= len(train) > 1000  # per-document distinct, summed
    for s in report["eval_sets"]:
        if s["overlap_percent"] is None:
            continue
        path = recipe.output / "eval" / s["path"].removeprefix("@holdout/")
        units, _ = read_eval_set(s["kind"], path if s["path"][0] == "@" else root / s["path"])
        grams = {g for u in units for g in word_ngrams(u["text"])}
        exact = len(grams & train)
        assert len(grams) == s["ngrams"] and s["found"] == exact, s
        assert exact <= s["bloom_found"] <= exact + 3, s


def test_exact_overlap_and_the_bloom_filter_agree_within_its_rate(tmp_path, documents):
    """The per-partition exact path against a Bloom filter of the same training text, on
    evaluation sets that share from none to all of their 8-grams with it."""
    from megadata.documents import write_docs
    from megadata.stages import decontaminate

    texts = [d["text"] for d in documents]
    train, rest = texts[: len(texts) // 2], texts[len(texts) // 2 :]
    for i in range(4):
        write_docs(tmp_path / f"p{i}.arrow", [
            {"doc_id": f"{i}/{j}", "title": "", "text": t} for j, t in enumerate(train[i::4])
        ])  # fmt: skip
    (tmp_path / "half.txt").write_text("\n\n".join(train[::2] + rest[::2]))
    (tmp_path / "none.txt").write_text("\n\n".join(rest[1::2]))
    sets = [
        {"name": n, "kind": "text", "path": str(tmp_path / f"{n}.txt"), "as_given": n}
        for n in ("half", "none")
    ]
    cfg = decontaminate.settings({"bloom_shards": 2, "train_bloom": True, "fpr": 0.01})
    prep = tmp_path / "prep"
    decontaminate.prepare_eval_sets(sets, str(prep), cfg)
    removal, found, digests = {"docs_in": 0, "docs_out": 0, "bytes_in": 0, "bytes_out": 0}, [], []
    for i in range(4):
        counts = decontaminate.remove_partition(
            str(tmp_path / f"p{i}.arrow"), str(tmp_path / f"out{i}.arrow"), str(prep), cfg,
            str(tmp_path / f"found{i}.arrow"), str(tmp_path / f"digests{i}.arrow"),
        )  # fmt: skip
        for key in removal:
            removal[key] += counts[key]
        found.append(str(tmp_path / f"found{i}.arrow"))
        digests.append(str(tmp_path / f"digests{i}.arrow"))
    removal["extra"] = {"train_ngrams": 0}
    bloom_dir = tmp_path / "reports" / "train_8grams"
    for k in range(2):
        decontaminate.build_bloom_shard(digests, k, str(bloom_dir), cfg)
    parts = [str(tmp_path / f"out{i}.arrow") for i in range(4)]
    decontaminate.write_report(
        parts, str(prep), str(tmp_path / "reports"), cfg, removal, found, str(bloom_dir)
    )
    report = json.loads((tmp_path / "reports" / "decontamination.json").read_text())
    grams = set().union(*(word_ngrams(t) for t in train))
    one = BloomFilter(sum(len(word_ngrams(t)) for t in train), fpr=0.01)
    one.add_many(g for t in train for g in word_ngrams(t))
    rows = {r["name"]: r for r in report["eval_sets"]}
    for name in ("half", "none"):
        units = [{"text": (tmp_path / f"{name}.txt").read_text()}]  # a text set: one unit
        exact = len(word_ngrams(units[0]["text"]) & grams)
        single = set_overlap(one, units, 8)
        row = rows[name]
        assert row["found"] == exact and row["ngrams"] == single["ngrams"]
        slack = 3 * 0.01 * (row["ngrams"] - exact) + 3  # the filters' false positives
        assert (
            exact <= row["bloom_found"] <= exact + slack
            and exact <= single["found"] <= exact + slack
        )
    # Docstrings of one module repeat each other: "none" shares a little, "half" a lot.
    assert rows["half"]["overlap_percent"] > 30 > 3 * rows["none"]["overlap_percent"]


def test_held_out_docs_left_the_shards_and_the_eval_files_have_the_format(built):
    recipe, _ = built
    eval_dir = recipe.output / "eval"
    summary = json.loads((eval_dir / "holdout.json").read_text())
    held = [d["doc_id"] for d in summary["docs"]]
    assert len(held) >= 2 and all(i.startswith("notes/") for i in held)
    assert summary["counts"]["held_out"] == len(held)
    shard_ids = _shard_ids(recipe.output)
    assert not set(held) & set(shard_ids)
    dedup_ids = {d["doc_id"] for p in (recipe.work / "dedup").glob("*.arrow") for d in read_docs(p)}
    removed = {"pydocs/docs.jsonl#2", "pydocs/docs.jsonl#9"}
    assert sorted(shard_ids) == sorted(dedup_ids - set(held) - removed)

    wikitext = (eval_dir / "wiki.test.tokens").read_text()
    assert wikitext.startswith(" \n = ")
    lines = wikitext.splitlines()
    titles = [line for line in lines if line.startswith(" = ") and " = = " not in line]
    assert len(titles) == len(held)
    assert all(line.startswith(" ") and line.endswith(" ") for line in lines)
    held_text = " ".join(d["text"] for p in (recipe.work / "holdout_docs").glob("*.arrow")
                         for d in read_docs(p))  # fmt: skip
    if "-" in held_text:
        assert " @-@ " in wikitext
    assert len(wikitext.split()) == summary["counts"]["wikitext_tokens"]

    lines = (eval_dir / "lambada.jsonl").read_text().splitlines()
    assert len(lines) == summary["counts"]["lambada_passages"] >= 1
    for line in lines:
        text = json.loads(line)["text"]
        assert 60 <= len(text.split()) <= 120 and text.split()[-1].isalpha()
        assert text.rsplit(" ", 1)[0].split()[:5] == text.split()[:5]


def _bytes(corpus: Path) -> dict[str, str]:
    files = [*corpus.glob("*/shard-*.arrow"), *corpus.glob("eval/*"), *corpus.glob("reports/**/*")]
    files = [p for p in files if p.is_file()]
    return {
        str(p.relative_to(corpus)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(files)
    }


def test_a_rerun_with_two_workers_gives_the_same_bytes(tmp_path, built, inputs, documents):
    recipe, _ = built
    root = recipe.path.parent
    path = _write_recipe(root, inputs, documents, tmp_path / "corpus")
    other = load_recipe(path.rename(root / "r2.toml"))
    run_recipe(other, workers=2, progress=False)
    assert _bytes(other.output) == _bytes(recipe.output)
    # The cluster's start-up is a row of its own in the manifest (no cluster for one worker).
    start = json.loads((other.output / "manifest.json").read_text())["cluster_start"]
    assert (
        start["stage"] == "cluster start"
        and start["seconds"] > 0
        and start["extra"]["workers"] == 2
    )
    assert json.loads((recipe.output / "manifest.json").read_text())["cluster_start"] is None
    assert "reports/decontamination.json" in _bytes(recipe.output)


def test_overlap_command_measures_a_file_against_the_saved_filter(tmp_path, built):
    recipe, _ = built
    root, bloom = recipe.path.parent, recipe.output / "reports" / "train_8grams"
    out = tmp_path / "overlap.json"
    result = CliRunner().invoke(
        main,
        ["overlap", "--bloom", str(bloom), "--eval", f"text:{root / 'eval' / 'copied.txt'}",
         "--eval", f"lambada:{root / 'eval' / 'empty.jsonl'}", "--json", str(out)],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "copied.txt" in result.output and "100.00" in result.output and "n/a" in result.output
    rows = json.loads(out.read_text())["eval_sets"]
    report = json.loads((recipe.output / "reports" / "decontamination.json").read_text())
    copied = next(s for s in report["eval_sets"] if s["name"] == "copied")
    assert (rows[0]["ngrams"], rows[0]["found"]) == (copied["ngrams"], copied["bloom_found"])
    bad = CliRunner().invoke(main, ["overlap", "--bloom", str(bloom), "--eval", "wiki:x"])
    assert bad.exit_code == 2 and "expected KIND:PATH" in bad.output
    short = tmp_path / "short.bloom"
    short.write_bytes(next(bloom.glob("*.bloom")).read_bytes()[:-1])
    bad = CliRunner().invoke(main, ["overlap", "--bloom", str(short), "--eval", "text:x"])
    assert bad.exit_code == 2 and "short.bloom: truncated" in bad.output
    partial = tmp_path / "partial"
    partial.mkdir()
    for f in sorted(bloom.glob("*.bloom"))[:2]:
        (partial / f.name).write_bytes(f.read_bytes())
    text = root / "eval" / "copied.txt"
    bad = CliRunner().invoke(main, ["overlap", "--bloom", str(partial), "--eval", f"text:{text}"])
    assert bad.exit_code == 2 and "lacks ['shard-00002-of-00003.bloom']" in bad.output


def test_a_missing_eval_file_names_the_recipe_field(tmp_path, inputs):
    path = write_recipe(tmp_path / "r.toml", inputs, tmp_path / "corpus")
    sets = [{"name": "wt", "kind": "wikitext", "path": "nowhere/wiki.test.tokens"}]
    path.write_text(path.read_text() + _decontaminate_section(sets))
    with (
        Runner(workers=1, progress=False) as runner,
        pytest.raises(
            RecipeError, match=r"decontaminate\.eval_sets\[0\]\.path: .*nowhere/wiki\.test\.tokens"
        ),
    ):
        run_stage(load_recipe(path), "decontaminate", runner)
    held = [{"name": "h", "kind": "wikitext", "path": "@holdout/wiki.test.tokens"}]
    path.write_text(path.read_text().split("[decontaminate]")[0] + _decontaminate_section(held))
    with (
        Runner(workers=1, progress=False) as runner,
        pytest.raises(
            RecipeError, match=r"eval_sets\[0\]\.path is '@holdout/wiki.test.tokens' but the recipe"
        ),
    ):
        run_stage(load_recipe(path), "decontaminate", runner)
