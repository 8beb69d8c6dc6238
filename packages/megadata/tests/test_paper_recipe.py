"""pipelines/corpus/paper.toml, the paper's recipe, run as shipped on small stand-ins for its
four sources, GPT-2-style vocab/merges files and the two evaluation sets."""

import bz2
import json
import shutil
from pathlib import Path

import pyarrow as pa
import pytest
from corpus_inputs import wiki_dump

from megadata.recipe import RecipeError, load_recipe, run_recipe
from megadata.wikitext_format import format_articles

PAPER = Path(__file__).resolve().parents[3] / "pipelines/corpus/paper.toml"


def _bpe_files(texts: list[str], out: Path) -> None:
    """vocab.json + merges.txt of a small byte-level BPE, in GPT-2's file format."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer)
    out.mkdir(parents=True)
    tok.model.save(str(out))


def _stand_ins(root: Path, docs: list[dict]) -> dict:
    """The files the recipe names, under root/data/raw, each source a quarter of `docs`."""
    raw = root / "data/raw"
    quarter = len(docs) // 4
    wiki, stories, news, web = (docs[i * quarter : (i + 1) * quarter] for i in range(4))
    (raw / "wikipedia").mkdir(parents=True)
    dump = raw / "wikipedia/enwiki-latest-pages-articles1.xml.bz2"
    dump.write_bytes(bz2.compress(wiki_dump(wiki).encode()))
    for i, d in enumerate(stories):  # one story per file, lines broken as CC-Stories' are
        story = raw / f"cc-stories/part{i % 2}/story{i:03d}.txt"
        story.parent.mkdir(parents=True, exist_ok=True)
        story.write_text(d["text"].replace(". ", ".\n"))
    for name, part in (("realnews/realnews.jsonl", news), ("openwebtext/pages.jsonl", web)):
        (raw / name).parent.mkdir(parents=True)
        (raw / name).write_text(
            "".join(json.dumps({"text": d["text"], "title": d["title"]}) + "\n" for d in part)
        )
    _bpe_files([d["text"] for d in docs], raw / "gpt2")
    # WikiText103's test set holds one of the Wikipedia articles: it must leave training.
    planted = wiki[0]
    (raw / "wikitext-103").mkdir()
    (raw / "wikitext-103/wiki.test.tokens").write_text(
        format_articles([(planted["title"], planted["text"]), ("Unrelated", "Nothing here. " * 9)])
    )
    (raw / "lambada").mkdir()
    (raw / "lambada/lambada_test.jsonl").write_text(
        json.dumps({"text": "He opened the door and looked out at the garden"}) + "\n"
    )
    return {"planted": planted["title"], "sources": ("wikipedia", "cc-stories", "realnews")}


def test_paper_recipe_refuses_missing_inputs_naming_them(tmp_path):
    recipe = load_recipe(PAPER, output=tmp_path / "corpus")
    with pytest.raises(RecipeError, match=r"source 'wikipedia': no file matches .*enwiki"):
        recipe.source_files(recipe.sources[0])


def test_paper_recipe_runs_as_shipped(tmp_path, documents):
    pipelines = tmp_path / "pipelines/corpus"
    pipelines.mkdir(parents=True)
    shutil.copy(PAPER, pipelines / "paper.toml")  # its ../../data/raw paths land in tmp_path
    facts = _stand_ins(tmp_path, documents)
    recipe = load_recipe(pipelines / "paper.toml")
    assert recipe.output == tmp_path / "data/corpus/paper"
    assert recipe.filter.min_tokens == 128 and recipe.dedup.threshold == 0.7
    assert recipe.decontaminate.fpr == 0.001 and recipe.shard.valid_every == 30
    run_recipe(recipe, workers=1, progress=False)

    corpus = recipe.output
    manifest = json.loads((corpus / "manifest.json").read_text())
    assert manifest["tokenizer"]["vocab_size"] == 600
    ids = []
    for split in ("train", "valid"):
        for shard in manifest["splits"][split]["shards"]:
            table = pa.ipc.open_file(pa.memory_map(str(corpus / shard["file"]))).read_all()
            ids += table.column("doc_id").to_pylist()
    for source in facts["sources"]:
        assert any(i.startswith(source) for i in ids), source
    report = json.loads((corpus / "reports/decontamination.json").read_text())
    removed = [r["title"] for r in report["removed"]]
    assert removed == [facts["planted"]], report["removed"]
