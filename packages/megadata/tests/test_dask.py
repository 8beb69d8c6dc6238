"""megadata on Dask: a LocalCluster of 2 workers builds the same bytes as one process, the
distributed dedup grouping equals a brute-force reference, a worker killed mid-run loses and
repeats no document, and an unreachable scheduler is named."""

import hashlib
import importlib
import json
import logging
import os
import random
import socket
import sys
import time
from collections import defaultdict
from pathlib import Path

import pytest
from click.testing import CliRunner
from corpus_inputs import english_documents, write_inputs, write_recipe
from datasketch import LeanMinHash, MinHashLSH

from megadata import runner as runner_module
from megadata.cli import main
from megadata.documents import read_meta, read_table, write_docs
from megadata.planted import plant
from megadata.recipe import load_recipe, run_recipe
from megadata.runner import Runner, SchedulerError
from megadata.stages import clean, dedup


@pytest.fixture(scope="module")
def cluster():
    from distributed import LocalCluster

    with LocalCluster(
        n_workers=2,
        threads_per_worker=1,
        processes=True,
        dashboard_address=None,
        scheduler_kwargs={"dashboard_address": "127.0.0.1:0"},
        silence_logs=logging.ERROR,
    ) as c:
        yield c


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, documents):
    return write_inputs(tmp_path_factory.mktemp("inputs"), documents)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, inputs):
    """The test recipe built in one process (workers=1)."""
    root = tmp_path_factory.mktemp("one-process")
    recipe = load_recipe(write_recipe(root / "r.toml", inputs, root / "corpus"))
    run_recipe(recipe, workers=1, progress=False)
    return recipe.output


def corpus_files(corpus: Path) -> dict[str, str]:
    """sha256 of every file of the corpus directory (manifest.json less its timings and
    memory)."""
    files = {}
    for path in sorted(corpus.rglob("*")):
        rel = path.relative_to(corpus)
        if path.is_dir() or rel.parts[0] == "_work":
            continue
        if rel == Path("manifest.json"):
            manifest = json.loads(path.read_text())
            manifest.pop("cluster_start")  # measurements, like the stages' below
            for stage in manifest["stages"]:
                stage.pop("seconds")
                stage.pop("cpu_seconds")
                stage.pop("peak_rss_mb")
            files[str(rel)] = manifest
        else:
            files[str(rel)] = hashlib.sha256(path.read_bytes()).hexdigest()
    return files


def shard_doc_ids(corpus: Path) -> list[str]:
    return [
        doc_id
        for path in sorted(corpus.glob("*/shard-*.arrow"))
        for doc_id in read_table(path).column("doc_id").to_pylist()
    ]


def test_local_cluster_of_two_workers_gives_the_same_bytes(tmp_path, cluster, inputs, reference):
    recipe = load_recipe(write_recipe(tmp_path / "r.toml", inputs, tmp_path / "corpus"))
    results = run_recipe(recipe, progress=False, scheduler=cluster.scheduler_address)
    files = corpus_files(recipe.output)
    assert any(name.startswith("train/shard-") for name in files)
    assert "reports/dedup_clusters.jsonl" in files and "manifest.json" in files
    assert files == corpus_files(reference)
    assert results[-1].docs_out == len(shard_doc_ids(reference))


def test_a_bert_corpus_is_the_same_bytes_on_one_process_and_on_the_cluster(
    tmp_path, cluster, inputs
):
    """WordPiece, learnt from the words the workers count, and sentence ends: the same
    files either way (HF's own WordPiece trainer gave another vocabulary on each run)."""
    bert = {"tokenizer": {"kind": "bert-wordpiece", "vocab_size": 1500}}
    corpora = []
    for where in ("one", "cluster"):
        out = tmp_path / where
        out.mkdir()
        recipe = load_recipe(write_recipe(out / "r.toml", inputs, out / "corpus", **bert))
        scheduler = cluster.scheduler_address if where == "cluster" else None
        run_recipe(recipe, workers=1, progress=False, scheduler=scheduler)
        corpora.append(corpus_files(recipe.output))
    assert "tokenizer.json" in corpora[0] and corpora[0] == corpora[1]


def dying_on_first_call(marker: Path, module, name: str):
    """`module.name` as a worker has it, except that the first call of a run (the one that
    creates `marker`) ends its own worker process on the spot.  A closure: Dask sends its
    code by value, as the workers cannot import a test module by name."""
    module_name = module.__name__

    def task(*args):
        try:
            fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return getattr(importlib.import_module(module_name), name)(*args)
        os.write(fd, str(os.getpid()).encode())
        os.close(fd)
        os._exit(1)

    return task


def test_killed_worker_loses_and_repeats_no_document(
    tmp_path, monkeypatch, cluster, inputs, reference
):
    """A worker dies in the clean stage and another in the dedup grouping's verification;
    Dask reruns their tasks elsewhere and the corpus comes out the same."""
    markers = []
    for module, name in ((clean, "clean_partition"), (dedup, "verify_against_first")):
        markers.append(tmp_path / f"killed-in-{name}")
        monkeypatch.setattr(module, name, dying_on_first_call(markers[-1], module, name))
    recipe = load_recipe(write_recipe(tmp_path / "r.toml", inputs, tmp_path / "corpus"))
    run_recipe(recipe, progress=False, scheduler=cluster.scheduler_address)
    for marker in markers:  # each stage really lost a worker
        assert int(marker.read_text()) != os.getpid()
    ids = shard_doc_ids(recipe.output)
    assert len(ids) == len(set(ids))  # no document twice
    assert sorted(ids) == sorted(shard_doc_ids(reference))  # none lost
    assert corpus_files(recipe.output) == corpus_files(reference)


def chained_corpus() -> list[dict]:
    """Near-duplicate clusters of several shapes among unrelated documents:
    chains of overlapping windows of one text (A~B, B~C, A!~C), a base with edited copies,
    exact copies (a tie broken by doc_id), and documents like no other."""
    words = " ".join(d["text"] for d in english_documents()).split()
    rows = []
    for c, start in enumerate((0, 3000)):  # windows of 400 words, 40 apart: J ~ 0.82 to the next
        for k in range(4 - c):
            text = " ".join(words[start + 40 * k : start + 40 * k + 400])
            rows.append({"doc_id": f"chain{c}/{k}", "text": text})
    bases = [" ".join(words[i : i + 300]) for i in range(5000, 7400, 300)]
    planted, _ = plant(bases[:3], fractions=(0.02, 0.05, 0.3), seed=1)
    rows += [{"doc_id": r["doc_id"], "text": r["text"]} for r in planted]
    rows += [{"doc_id": f"same/{i}", "text": bases[3]} for i in (2, 1)]
    rows += [{"doc_id": f"other/{i}", "text": b} for i, b in enumerate(bases[4:])]
    rows += [{"doc_id": f"short/{i}", "text": " ".join(words[8000 + 50 * i : 8050 + 50 * i])}
             for i in range(20)]  # fmt: skip
    random.Random(0).shuffle(rows)  # clusters spread over the partitions
    return [{**r, "source": "test"} for r in rows]


def brute_force(rows: list[dict], threshold: float, n: int) -> tuple[bytes, list[str]]:
    """The rule without LSH: every document in the survivor order (one source: the longest
    text, then the smallest doc_id) is kept unless its exact Jaccard to a document kept
    before it is above the threshold; it is then reported with the first such one."""
    sets = [dedup.shingles(r["text"], n) for r in rows]
    order = sorted(range(len(rows)), key=lambda i: (-len(rows[i]["text"]), rows[i]["doc_id"]))
    kept, removed_by = [], defaultdict(list)
    for i in order:
        for k in kept:
            j = dedup.jaccard(sets[i], sets[k])
            if j > threshold:
                removed_by[k].append((rows[i]["doc_id"], round(j, 6)))
                break
        else:
            kept.append(i)
    report = [
        {
            "survivor": rows[k]["doc_id"],
            "removed": [{"doc_id": d, "jaccard": j} for d, j in sorted(removed)],
        }
        for k, removed in removed_by.items()
    ]
    report.sort(key=lambda c: c["survivor"])
    lines = "".join(json.dumps(c, sort_keys=True) + "\n" for c in report).encode()
    return lines, sorted(d for c in report for d in (m["doc_id"] for m in c["removed"]))


def datasketch_candidates(signature_paths: list[str], threshold: float, num_perm: int) -> int:
    """Candidate pairs of datasketch's MinHashLSH with the same bands (the old code's way)."""
    sigs = []
    for path in signature_paths:
        flat = read_table(Path(path)).column("signature").combine_chunks().flatten().to_numpy()
        sigs += list(flat.reshape(-1, num_perm))
    lsh = MinHashLSH(num_perm=num_perm, params=dedup.choose_bands(threshold, num_perm))
    scheme = read_meta(Path(signature_paths[0]))["scheme"]
    hashes = [LeanMinHash(seed=1, hashvalues=s, scheme=scheme) for s in sigs]
    for i, h in enumerate(hashes):
        lsh.insert(i, h, check_duplication=False)
    pairs = {(min(i, j), max(i, j)) for i, h in enumerate(hashes) for j in lsh.query(h)}
    return len({(i, j) for i, j in pairs if i != j})


def test_distributed_grouping_equals_brute_force(tmp_path, cluster):
    threshold, num_perm, n = 0.7, 128, 2
    rows = chained_corpus()
    sets = {r["doc_id"]: dedup.shingles(r["text"], n) for r in rows}
    # The corpus has what makes connected components matter: a chain A~B~C with A!~C.
    assert dedup.jaccard(sets["chain0/0"], sets["chain0/1"]) > threshold
    assert dedup.jaccard(sets["chain0/1"], sets["chain0/2"]) > threshold
    assert dedup.jaccard(sets["chain0/0"], sets["chain0/2"]) < threshold
    sig_paths, doc_paths = [], []
    for k in range(4):
        doc_paths.append(str(tmp_path / f"docs-{k}.arrow"))
        sig_paths.append(str(tmp_path / f"sig-{k}.arrow"))
        write_docs(Path(doc_paths[-1]), rows[k::4])
        dedup.signature_partition(doc_paths[-1], sig_paths[-1], num_perm, n, 1)
    expected_lines, expected_removed = brute_force(rows, threshold, n)

    with Runner(progress=False, scheduler=cluster.scheduler_address) as on_cluster:
        counts = dedup.find_duplicates(
            sig_paths,
            doc_paths,
            str(tmp_path / "lsh"),
            threshold,
            num_perm,
            n,
            runner=on_cluster,
            shards=5,
        )
    lines = (tmp_path / "lsh" / "clusters.jsonl").read_bytes()
    assert lines == expected_lines
    assert json.loads((tmp_path / "lsh" / "removed.json").read_text()) == expected_removed
    extra = counts["extra"]
    assert extra["clusters"] == len(expected_lines.splitlines())
    assert extra["removed"] == len(expected_removed) == counts["docs_in"] - counts["docs_out"]
    # Each removal is one verified pair; fewer pairs were compared than LSH proposes.
    assert extra["verified_pairs"] == extra["removed"]
    assert (
        extra["removed"]
        < extra["candidate_pairs"]
        < datasketch_candidates(sig_paths, threshold, num_perm)
    )
    # Every removed document is above the threshold to the kept one it is reported with; a
    # chain's ends, below it to each other, are not removed through its middle: no kept
    # document is above the threshold to both chain0/0 and chain0/3, so two or more stay.
    report = [json.loads(c) for c in lines.splitlines()]
    for c in report:
        for m in c["removed"]:
            assert m["jaccard"] > threshold
            assert dedup.jaccard(sets[m["doc_id"]], sets[c["survivor"]]) == pytest.approx(
                m["jaccard"], abs=1e-6
            )
    chain_removed = {m["doc_id"] for c in report for m in c["removed"]} & {
        f"chain0/{k}" for k in range(4)
    }
    assert 1 <= len(chain_removed) <= 2
    assert (tmp_path / "lsh" / "label-001" / "_DONE.json").exists()  # labels propagated

    # The same in this process, with another number of shards.
    counts_here = dedup.find_duplicates(
        sig_paths, doc_paths, str(tmp_path / "here"), threshold, num_perm, n, shards=2
    )
    assert (tmp_path / "here" / "clusters.jsonl").read_bytes() == expected_lines
    assert counts_here["extra"] == extra


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_workers_keep_large_arrays_on_the_heap(monkeypatch):
    """Dask's default MALLOC_TRIM_THRESHOLD_ doubles the CPU of numpy-heavy tasks (every
    large array mapped afresh): the Runner's own workers start without it, and a task on a
    worker that has it (a real cluster's) sets glibc's thresholds back first."""
    # A nanny puts the variable into its own process too (the `cluster` fixture's did, in
    # this one), and workers inherit what their parent has: start from a clean one.
    monkeypatch.delenv("MALLOC_TRIM_THRESHOLD_", raising=False)
    with Runner(workers=2, progress=False) as on_cluster:
        found = on_cluster._dask().run(os.environ.get, "MALLOC_TRIM_THRESHOLD_")
    assert len(found) == 2 and set(found.values()) == {None}
    undo = runner_module._keep_large_arrays_on_the_heap.__wrapped__
    assert undo() is False
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "65536")
    assert undo() is (sys.platform == "linux")  # glibc took both settings


def test_unreachable_scheduler_is_named_quickly(tmp_path, monkeypatch, inputs):
    monkeypatch.setattr(runner_module, "CONNECT_TIMEOUT_S", 1.0)
    address = f"tcp://127.0.0.1:{closed_port()}"
    start = time.perf_counter()
    expected = f"--scheduler {address}: no Dask scheduler"
    with pytest.raises(SchedulerError, match=expected), Runner(scheduler=address):
        pass
    assert time.perf_counter() - start < 5
    recipe = write_recipe(tmp_path / "r.toml", inputs, tmp_path / "corpus")
    args = ["run", "--recipe", str(recipe), "--no-progress", "--scheduler", address]
    result = CliRunner().invoke(main, args, prog_name="megadata")
    assert result.exit_code == 2
    assert f"megadata run: --scheduler {address}: no Dask scheduler answered within 1 s" in (
        result.output
    )
    assert "Traceback" not in result.output
