"""The whole recipe: the corpus contract, worker-count independence, kill -9 resume, bad input."""

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import pyarrow as pa
import pytest
from click.testing import CliRunner
from corpus_inputs import write_inputs, write_recipe

from megadata.cli import main
from megadata.recipe import RecipeError, load_recipe, run_recipe


def _shards(corpus: Path) -> dict[str, str]:
    return {
        str(p.relative_to(corpus)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(corpus.glob("*/shard-*.arrow"))
    }


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, documents):
    return write_inputs(tmp_path_factory.mktemp("inputs"), documents)


@pytest.fixture(scope="module")
def built(tmp_path_factory, inputs):
    """The test recipe built once with 1 worker: (recipe, stage results)."""
    root = tmp_path_factory.mktemp("one-worker")
    recipe = load_recipe(write_recipe(root / "r.toml", inputs, root / "corpus"))
    return recipe, run_recipe(recipe, workers=1, progress=False)


def test_corpus_directory_follows_the_contract(built):
    recipe, results = built
    corpus = recipe.output
    manifest = json.loads((corpus / "manifest.json").read_text())
    assert manifest["format_version"] == 1
    tok = manifest["tokenizer"]
    assert tok["kind"] == "gpt2-bpe" and tok["file"] == "tokenizer.json"
    assert tok["sha256"] == hashlib.sha256((corpus / "tokenizer.json").read_bytes()).hexdigest()
    assert [r.stage for r in results] == [
        "ingest", "clean", "tokenizer", "filter", "dedup", "holdout", "decontaminate",
        "tokenize", "shard",
    ]  # fmt: skip
    total_docs = 0
    for split in ("train", "valid"):
        info = manifest["splits"][split]
        assert info["shards"], split
        docs = tokens = 0
        for entry in info["shards"]:
            path = corpus / entry["file"]
            assert entry["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
            table = pa.ipc.open_file(pa.memory_map(str(path))).read_all()
            assert table.schema.field("tokens").type == pa.list_(pa.uint16())
            for row in table.column("tokens").to_pylist():
                assert row[-1] == tok["eod_id"] and tok["eod_id"] not in row[:-1]
            docs += table.num_rows
            tokens += sum(len(r) for r in table.column("tokens").to_pylist())
            assert entry["docs"] == table.num_rows and entry["tokens"] == tokens - sum(
                e["tokens"] for e in info["shards"][: info["shards"].index(entry)]
            )
        assert (docs, tokens) == (info["docs"], info["tokens"])
        total_docs += docs
    assert total_docs == results[-1].docs_out == results[4].docs_out
    # Every stage reports its counts, and the documents flow from one to the next.
    assert results[0].docs_out == results[1].docs_in
    assert (
        results[3].tokens > 0
        and results[7].tokens
        == manifest["splits"]["train"]["tokens"] + (manifest["splits"]["valid"]["tokens"])
    )
    assert (corpus / "reports" / "dedup_clusters.jsonl").exists()


def test_manifest_records_each_stage_as_printed(built):
    """The manifest's stages are the rows `megadata run` prints: wall and CPU seconds of
    every step of a stage (dedup: signatures, grouping, removal) and its statistics."""
    recipe, results = built
    manifest = json.loads((recipe.output / "manifest.json").read_text())
    assert manifest["stages"] == [asdict(r) for r in results[:-1]]
    dedup = manifest["stages"][4]
    assert dedup["stage"] == "dedup"
    assert {"candidate_pairs", "verified_pairs", "clusters", "removed"} <= set(dedup["extra"])
    assert dedup["extra"]["removed"] == dedup["docs_in"] - dedup["docs_out"]
    steps = [
        json.loads((recipe.work / d / "_DONE.json").read_text())
        for d in ("signatures", "lsh", "dedup")
    ]
    assert dedup["seconds"] >= sum(s["seconds"] for s in steps) > steps[-1]["seconds"]
    assert dedup["cpu_seconds"] >= steps[0]["cpu_seconds"] > 0
    assert all(s["cpu_seconds"] > 0 for s in manifest["stages"])


def test_two_workers_give_the_same_bytes(tmp_path, built, inputs):
    recipe, _ = built
    other = load_recipe(write_recipe(tmp_path / "r.toml", inputs, tmp_path / "corpus"))
    run_recipe(other, workers=2, progress=False)
    assert _shards(other.output) == _shards(recipe.output)
    assert (other.output / "tokenizer.json").read_bytes() == (
        recipe.output / "tokenizer.json"
    ).read_bytes()


def test_killed_at_any_moment_resumes_to_the_same_corpus(tmp_path, built, inputs):
    """kill -9 the whole run (workers too) at growing delays, then let it finish."""
    recipe, _ = built
    path = write_recipe(tmp_path / "r.toml", inputs, tmp_path / "corpus")
    cmd = [sys.executable, "-c", "from megadata.cli import main; main()"]
    cmd += ["run", "--recipe", str(path), "--no-progress"]
    kills = 0
    for delay in (0.8, 1.6, 2.4, 3.2, 4.0, 5.0):
        proc = subprocess.Popen(
            cmd, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        time.sleep(delay)
        if proc.poll() is not None:
            break
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        kills += 1
        _manifest_means_complete(tmp_path / "corpus")
    assert kills >= 2
    final = subprocess.run(cmd, capture_output=True, text=True)
    assert final.returncode == 0, final.stderr
    assert _shards(tmp_path / "corpus") == _shards(recipe.output)
    leftovers = [p for p in (tmp_path / "corpus").rglob("*.tmp")]
    assert leftovers == [] or all("_work" in str(p) for p in leftovers)


def _manifest_means_complete(corpus: Path) -> None:
    """A manifest is written last: if there is one, every shard it lists is there and whole."""
    if not (corpus / "manifest.json").exists():
        return
    manifest = json.loads((corpus / "manifest.json").read_text())
    for split in manifest["splits"].values():
        for entry in split["shards"]:
            data = (corpus / entry["file"]).read_bytes()
            assert hashlib.sha256(data).hexdigest() == entry["sha256"]


def test_output_of_another_recipe_is_refused(tmp_path, built, inputs):
    recipe, _ = built
    other = write_recipe(tmp_path / "r.toml", inputs, recipe.output, filter={"min_tokens": 10})
    with pytest.raises(RecipeError, match=r"holds a corpus of another recipe \('test'"):
        run_recipe(load_recipe(other), workers=1, progress=False)
    result = CliRunner().invoke(main, ["run", "--recipe", str(other), "--no-progress"])
    assert result.exit_code == 2 and "holds a corpus of another recipe" in result.output


def test_stage_needs_its_input_stage(tmp_path, inputs):
    recipe = write_recipe(tmp_path / "r.toml", inputs, tmp_path / "corpus")
    result = CliRunner().invoke(main, ["dedup", "--recipe", str(recipe), "--no-progress"])
    assert result.exit_code == 2
    assert "stage 'filter' of" in result.output and "run `megadata filter` first" in result.output
    result = CliRunner().invoke(main, ["ingest", "--recipe", str(recipe), "--no-progress"])
    assert result.exit_code == 0 and "ingest" in result.output


def test_a_corpus_takes_another_corpus_tokenizer_as_its_own(tmp_path, built, inputs):
    """Corpora to blend share one tokenizer: a recipe naming another corpus's tokenizer.json
    keeps its bytes (the same sha256 in both manifests) and records where it came from."""
    recipe, _ = built
    first = json.loads((recipe.output / "manifest.json").read_text())["tokenizer"]
    source = recipe.output / "tokenizer.json"
    second = load_recipe(
        write_recipe(
            tmp_path / "r.toml",
            inputs,
            tmp_path / "corpus",
            tokenizer={"tokenizer_json": str(source), "vocab_size": first["vocab_size"]},
        )
    )
    run_recipe(second, workers=1, progress=False)
    tok = json.loads((second.output / "manifest.json").read_text())["tokenizer"]
    assert (second.output / "tokenizer.json").read_bytes() == source.read_bytes()
    assert tok["sha256"] == first["sha256"] and tok["eod_id"] == first["eod_id"]
    assert tok["source"] == {"file": str(source.resolve()), "sha256": first["sha256"]}
    assert "source" not in first  # a trained tokenizer names none


def test_tokenizer_that_does_not_match_the_recipe(tmp_path, built, inputs):
    recipe, _ = built
    bad = write_recipe(
        tmp_path / "r.toml",
        inputs,
        tmp_path / "corpus",
        tokenizer={"tokenizer_json": str(recipe.output / "tokenizer.json"), "vocab_size": 50257},
    )
    result = CliRunner().invoke(
        main, ["run", "--recipe", str(bad), "--no-progress", "--workers", "1"]
    )
    assert result.exit_code == 2
    assert "tokens but the recipe says tokenizer.vocab_size = 50257" in result.output


def test_missing_inputs_are_named(tmp_path, inputs):
    recipe = write_recipe(
        tmp_path / "r.toml", {**inputs, "wiki": tmp_path / "nowhere.xml"}, tmp_path / "c"
    )
    with pytest.raises(RecipeError, match=r"source 'wiki': no file matches .*nowhere.xml"):
        run_recipe(load_recipe(recipe), workers=1, progress=False)


def test_source_names_unique_and_a_bare_work_dir_is_ours(tmp_path, inputs):
    path = write_recipe(tmp_path / "r.toml", inputs, tmp_path / "corpus")
    text = path.read_text().replace('name = "notes"', 'name = "pydocs"')
    (tmp_path / "dup.toml").write_text(text)
    with pytest.raises(RecipeError, match="source names must be unique"):
        load_recipe(tmp_path / "dup.toml")
    # A run killed before its recipe marker landed leaves only _work/ with a temporary file.
    (tmp_path / "corpus" / "_work").mkdir(parents=True)
    (tmp_path / "corpus" / "_work" / ".recipe.json.x.tmp").write_text("{")
    from megadata.recipe import claim_output

    claim_output(load_recipe(path))
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(RecipeError, match="is not empty and was not made by megadata"):
        claim_output(load_recipe(path, output=tmp_path / "other"))


def _count_call(marker_dir: str, i: int) -> dict:
    Path(marker_dir, f"ran-{i}").touch()
    return {"docs_in": i}


def test_a_marker_cut_short_by_a_power_cut_runs_its_task_again(tmp_path):
    """Task markers are not synced to disk: one left empty or cut short means the task is
    run again, never a failed resume."""
    from megadata.runner import Runner, Task

    tasks = [Task(f"t{i}", (str(tmp_path), i)) for i in range(4)]
    stage = tmp_path / "stage"
    assert Runner(workers=1, progress=False).run("s", stage, tasks, _count_call).docs_in == 6
    (stage / "_DONE.json").unlink()
    (stage / "_tasks" / "t2.json").write_text("")  # empty
    (stage / "_tasks" / "t3.json").write_text('{"docs_in": 3, "cpu')  # cut short
    for f in tmp_path.glob("ran-*"):
        f.unlink()
    assert Runner(workers=1, progress=False).run("s", stage, tasks, _count_call).docs_in == 6
    assert sorted(f.name for f in tmp_path.glob("ran-*")) == ["ran-2", "ran-3"]


def test_a_grouping_without_its_removed_nodes_names_the_file_and_the_way_out(tmp_path, built):
    """An lsh/ grouped by an earlier megadata (removed-nodes.arrow, no .npy) stops the
    dedup step before any removal task, naming the file; deleting lsh/ as told lets the
    rerun group again and give the same partitions."""
    import shutil

    from megadata.stages import dedup

    recipe, _ = built
    corpus = tmp_path / "corpus"
    shutil.copytree(recipe.output, corpus)
    other = load_recipe(recipe.path, output=corpus)
    lsh = other.work / "lsh"
    (lsh / dedup.REMOVED_NODES).rename(lsh / "removed-nodes.arrow")
    shutil.rmtree(other.work / "dedup")
    with pytest.raises(FileNotFoundError, match=r"removed-nodes\.npy is missing: delete .*lsh"):
        run_recipe(other, workers=1, progress=False, stages=["dedup"])
    assert not (other.work / "dedup").exists()
    shutil.rmtree(lsh)
    run_recipe(other, workers=1, progress=False, stages=["dedup"])
    for p in sorted((recipe.work / "dedup").glob("*.arrow")):
        assert (other.work / "dedup" / p.name).read_bytes() == p.read_bytes()


def test_stages_done_by_an_earlier_megadata_are_not_redone(tmp_path, built):
    """An ingest done without file pieces (no _lines/) and a shard stage done in one task
    (no count/ and write/) keep their totals when run again: nothing is counted, read or
    written anew."""
    import shutil

    recipe, _ = built
    corpus = tmp_path / "corpus"
    shutil.copytree(recipe.output, corpus)
    other = load_recipe(recipe.path, output=corpus)
    for gone in ("ingest/_lines", "shard/count", "shard/write"):
        shutil.rmtree(other.work / gone)
    shards = sorted(corpus.glob("*/shard-*.arrow"))
    before = {p: p.stat().st_mtime_ns for p in shards}
    rows = run_recipe(other, workers=1, progress=False, stages=["ingest", "shard"])
    assert [r.docs_out for r in rows] == [
        json.loads((other.work / s / "_DONE.json").read_text())["docs_out"]
        for s in ("ingest", "shard")
    ]
    assert not (other.work / "ingest/_lines").exists()
    assert not (other.work / "shard/write").exists()
    assert {p: p.stat().st_mtime_ns for p in shards} == before


def _large_byte_level_bpe(path: Path, fillers: int) -> Path:
    """A byte-level BPE tokenizer.json of 256 byte tokens, `fillers` more and Llama 3's two
    document tokens: over 65,536 ids, like Llama 3's 128k vocabulary."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    vocab |= {f"<filler {i}>": len(alphabet) + i for i in range(fillers)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|begin_of_text|>", "<|end_of_text|>"]
    tok.add_special_tokens([AddedToken(t, special=True) for t in specials])
    tok.save(str(path))
    return path


def test_an_existing_tokenizer_json_with_its_own_document_tokens_and_uint32_ids(tmp_path, inputs):
    tokenizer = _large_byte_level_bpe(tmp_path / "tokenizer.json", fillers=70_000)
    settings = {
        "tokenizer_json": str(tokenizer),
        "vocab_size": 256 + 70_000 + 2,
        "eod_token": "<|end_of_text|>",
        "bos_token": "<|begin_of_text|>",
    }
    recipe = load_recipe(
        write_recipe(tmp_path / "r.toml", inputs, tmp_path / "corpus", tokenizer=settings)
    )
    run_recipe(recipe, workers=1, progress=False)
    manifest = json.loads((recipe.output / "manifest.json").read_text())
    tok = manifest["tokenizer"]
    assert manifest["token_dtype"] == "uint32" and tok["vocab_size"] == 256 + 70_000 + 2
    bos, eod = tok["bos_id"], tok["eod_id"]
    assert (bos, eod) == (256 + 70_000, 256 + 70_000 + 1)
    docs = 0
    for entry in manifest["splits"]["train"]["shards"]:
        table = pa.ipc.open_file(pa.memory_map(str(recipe.output / entry["file"]))).read_all()
        assert table.schema.field("tokens").type == pa.list_(pa.uint32())
        for row in table.column("tokens").to_pylist():
            assert row[0] == bos and row[-1] == eod and bos not in row[1:] and eod not in row[:-1]
            docs += 1
    assert docs > 10
    # Without them the tokenizer's own document tokens are refused by name.
    bad = write_recipe(tmp_path / "bad.toml", inputs, tmp_path / "c2",
                       tokenizer={**settings, "eod_token": "<|eot_id|>"})  # fmt: skip
    result = CliRunner().invoke(main, ["run", "--recipe", str(bad), "--no-progress"])
    assert result.exit_code == 2, result.output
    assert "no '<|eot_id|>' token" in result.output and "tokenizer.eod_token" in result.output
