"""A corpus recipe (TOML under pipelines/corpus/) and the runner that chains the stages.

Stage directories live under `<output>/_work/`; the corpus itself (manifest.json,
tokenizer.json, train/, valid/, reports/) under `<output>/`.  The recipe's
fingerprint is kept in `<output>/_work/recipe.json`: an output directory built
from another recipe is refused rather than mixed.
"""

import hashlib
import json
import sys
from dataclasses import asdict, dataclass, field
from glob import glob
from pathlib import Path

from megadata import __version__
from megadata.documents import atomic_write_bytes, atomic_write_json, link_partition, read_docs
from megadata.encode import DEFAULT_SPLITTER, check_splitter, token_type
from megadata.file_pieces import count_newlines, how_to_split, pieces, split_bytes
from megadata.runner import Runner, StageStats, Task, finished_stage, task_counts
from megadata.stages import clean, decontaminate, dedup, filter, holdout, ingest, shard, tokenize
from megadata.tokenizer import build_tokenizer, eod_id, sha256_file

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

STAGES = (
    "ingest",
    "clean",
    "tokenizer",
    "filter",
    "dedup",
    "holdout",
    "decontaminate",
    "tokenize",
    "shard",
)
SOURCE_KINDS = ("text", "jsonl", "html", "wikipedia")
CLUSTER_START = "cluster-start"  # its row in _work/_stats/


class RecipeError(ValueError):
    pass


@dataclass
class Recipe:
    name: str
    path: Path
    output: Path
    sources: list[dict]
    clean: dict = field(default_factory=dict)
    tokenizer: dict = field(default_factory=dict)
    filter: dict = field(default_factory=dict)
    dedup: dict = field(default_factory=dict)
    holdout: dict = field(default_factory=dict)
    decontaminate: dict = field(default_factory=dict)
    shard: dict = field(default_factory=dict)
    partition_docs: int = 500
    sentence_splitter: str = DEFAULT_SPLITTER  # megadata.encode: BERT's sentence ends, LAMBADA
    raw: dict = field(default_factory=dict)

    @property
    def work(self) -> Path:
        return self.output / "_work"

    def fingerprint(self) -> str:
        canonical = json.dumps({k: v for k, v in self.raw.items() if k != "output"}, sort_keys=True)
        return hashlib.sha256(canonical.encode()).hexdigest()

    def source_files(self, source: dict) -> list[Path]:
        files = []
        for pattern in source["paths"]:
            pattern = str(pattern if Path(pattern).is_absolute() else self.path.parent / pattern)
            found = sorted(Path(p) for p in glob(pattern, recursive=True) if Path(p).is_file())
            if not found:
                raise RecipeError(
                    f"{self.path}: source {source['name']!r}: no file matches {pattern}"
                    + (
                        " (run `make data`, which fetches the sample inputs)"
                        if "data/raw" in pattern
                        else ""
                    )
                )
            files += found
        names = [f.name for f in files]
        if len(set(names)) != len(names):
            raise RecipeError(
                f"{self.path}: source {source['name']!r} has two files of the same name"
            )
        return files


def load_recipe(path: str | Path, output: str | Path | None = None) -> Recipe:
    path = Path(path).absolute()  # the sources are found relative to it, by any worker
    try:
        raw = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise RecipeError(f"recipe {path} does not exist") from None
    except tomllib.TOMLDecodeError as e:
        raise RecipeError(f"recipe {path}: not valid TOML ({e})") from None
    for key in ("name", "sources"):
        if key not in raw:
            raise RecipeError(f"recipe {path}: missing '{key}'")
    names = [s.get("name") for s in raw["sources"]]
    if len(set(names)) != len(names):
        raise RecipeError(f"recipe {path}: source names must be unique (doc ids start with them)")
    for i, s in enumerate(raw["sources"]):
        for key in ("name", "kind", "paths"):
            if key not in s:
                raise RecipeError(f"recipe {path}: sources[{i}] has no '{key}'")
        if s["kind"] not in SOURCE_KINDS:
            raise RecipeError(
                f"recipe {path}: sources[{i}].kind is {s['kind']!r}; expected one of {SOURCE_KINDS}"
            )
    try:  # a misspelt choice is refused before any stage runs
        clean.check_detector(raw.get("clean", {}).get("detector", clean.DEFAULT_DETECTOR))
        check_splitter(raw.get("sentence_splitter", DEFAULT_SPLITTER))
    except ValueError as e:
        raise RecipeError(f"recipe {path}: {e}") from None
    if output is not None:  # from the command line: relative to the working directory
        out = Path(output).absolute()  # absolute: tasks may run on other machines
    else:  # from the recipe: relative to the recipe file
        out = (path.parent / raw.get("output", f"corpus-{raw['name']}")).resolve()
    return Recipe(
        name=raw["name"],
        path=path,
        output=out,
        sources=raw["sources"],
        clean=raw.get("clean", {}),
        tokenizer=raw.get("tokenizer", {}),
        filter=raw.get("filter", {}),
        dedup=raw.get("dedup", {}),
        holdout=raw.get("holdout", {}),
        decontaminate=raw.get("decontaminate", {}),
        shard=raw.get("shard", {}),
        partition_docs=int(raw.get("partition_docs", 500)),
        sentence_splitter=raw.get("sentence_splitter", DEFAULT_SPLITTER),
        raw=raw,
    )


def claim_output(recipe: Recipe) -> None:
    """Record the recipe in its output directory; refuse one that holds another recipe's corpus."""
    marker = recipe.work / "recipe.json"
    if marker.exists():
        held = json.loads(marker.read_text())
        if held["fingerprint"] != recipe.fingerprint():
            raise RecipeError(
                f"{recipe.output} holds a corpus of another recipe ({held['name']!r} from "
                f"{held['path']}, or an earlier version of it); choose another --output or "
                f"delete {recipe.output}"
            )
        return
    # Only a `_work` without recipe.json can be there: a run killed before the marker landed.
    if recipe.output.exists() and any(p.name != "_work" for p in recipe.output.iterdir()):
        raise RecipeError(
            f"{recipe.output} is not empty and was not made by megadata for this recipe; "
            "choose another --output or empty it"
        )
    atomic_write_json(
        marker,
        {
            "name": recipe.name,
            "path": str(recipe.path),
            "fingerprint": recipe.fingerprint(),
            "megadata": __version__,
        },
    )


def _parts(stage_dir: Path) -> list[Path]:
    return sorted(stage_dir.glob("*.arrow"))


def _need(recipe: Recipe, stage: str) -> Path:
    d = recipe.work / stage
    if not (d / "_DONE.json").exists():
        raise RecipeError(
            f"stage '{stage}' of {recipe.output} is not complete: run `megadata {stage}` first"
        )
    return d


def _partition_tasks(src: Path, arguments) -> list[Task]:
    """A task per partition `p` of the stage directory `src`, with `arguments(p)`."""
    return [Task(p.stem, arguments(p)) for p in _parts(src)]


def _map(runner, recipe, stage, in_stage, fn, *extra) -> StageStats:
    src = _need(recipe, in_stage)
    out = recipe.work / stage
    tasks = [Task(p.stem, (str(p), str(out / p.name), *extra)) for p in _parts(src)]
    return runner.run(stage, out, tasks, fn)


def run_stage(recipe: Recipe, stage: str, runner: Runner) -> StageStats:
    """Run one stage (resuming it) and record its totals, the row `megadata` prints, in
    `_work/_stats/<stage>.json`: the manifest's `stages` are these."""
    stats = _run_stage(recipe, stage, runner)
    atomic_write_json(_stats_file(recipe, stage), asdict(stats))
    return stats


def _stats_file(recipe: Recipe, stage: str) -> Path:
    return recipe.work / "_stats" / f"{stage}.json"


def _cluster_start_row(recipe: Recipe) -> dict | None:
    start = cluster_start(recipe)
    return None if start is None else asdict(start)


def _stage_summary(recipe: Recipe, stage: str) -> dict:
    """What `run_stage` recorded; a stage finished by an older megadata has only its last
    step's `_DONE.json`."""
    path = _stats_file(recipe, stage)
    if not path.exists():
        path = recipe.work / stage / "_DONE.json"
    return json.loads(path.read_text())


def _run_stage(recipe: Recipe, stage: str, runner: Runner) -> StageStats:
    work = recipe.work
    if stage == "ingest":
        return _ingest(recipe, runner)
    if stage == "clean":
        return _map(runner, recipe, "clean", "ingest", clean.clean_partition, recipe.clean)
    if stage == "tokenizer":
        return _build_tokenizer(recipe, runner)
    tokenizer_path = str(recipe.output / "tokenizer.json")
    if stage == "filter":
        _need(recipe, "tokenizer")
        min_tokens = int(recipe.filter.get("min_tokens", 128))
        sentences, splitter = _sentence_settings(recipe)
        src, out, kept = _need(recipe, "clean"), work / "filter", work / "filter_tokens"
        head = (tokenizer_path, min_tokens)
        tasks = _partition_tasks(
            src,
            lambda p: (str(p), str(out / p.name), *head, str(kept / p.name), sentences, splitter),
        )
        return runner.run("filter", out, tasks, filter.filter_partition)
    if stage == "dedup":
        return _dedup(recipe, runner)
    if stage == "holdout":
        return _holdout(recipe, runner)
    if stage == "decontaminate":
        return _decontaminate(recipe, runner)
    if stage == "tokenize":
        kind = recipe.tokenizer.get("kind", "gpt2-bpe")
        from tokenizers import Tokenizer

        eod = eod_id(Tokenizer.from_file(tokenizer_path), kind)
        sentences, splitter = _sentence_settings(recipe)
        src, out = _need(recipe, "decontaminate"), work / "tokenize"
        kept, head = work / "filter_tokens", (tokenizer_path, eod, sentences)
        tasks = _partition_tasks(
            src,
            lambda p: (str(p), str(out / p.name), *head, str(kept / p.name), splitter),
        )
        return runner.run("tokenize", out, tasks, tokenize.tokenize_partition)
    if stage == "shard":
        return _shard(recipe, runner)
    raise RecipeError(f"unknown stage {stage!r}; stages are {', '.join(STAGES)}")


def _sentence_settings(recipe: Recipe) -> tuple[bool, str]:
    """(keep sentence ends?, the sentence splitter)."""
    kind = recipe.tokenizer.get("kind", "gpt2-bpe")
    sentences = bool(recipe.shard.get("sentence_boundaries", kind == "bert-wordpiece"))
    return sentences, recipe.sentence_splitter


def _ingest(recipe: Recipe, runner: Runner) -> StageStats:
    """A task per input file, or per piece of a large one (megadata.file_pieces), whose line
    numbers come from a first stage that counts the newlines of the pieces."""
    out, files, counting = recipe.work / "ingest", [], []
    lines_dir = out / "_lines"
    finished = finished_stage(out)
    if finished is not None and not lines_dir.exists():  # no file was cut in pieces
        return finished  # (or an earlier megadata ingested them): nothing to count again
    for source in recipe.sources:
        options = {k: v for k, v in source.items() if k not in ("name", "kind", "paths")}
        try:
            limit = split_bytes(options)
        except ValueError as e:
            raise RecipeError(f"recipe {recipe.path}: source {source['name']!r}: {e}") from None
        for i, f in enumerate(recipe.source_files(source)):
            how, count = how_to_split(source["kind"], options, f)
            name = f"{source['name']}-{i:05d}"
            files.append((source, options, f, i, name, how, count, limit))
            if how == "lines":
                for k in range(count - 1):  # the last piece's newlines are before no piece
                    end = min((k + 1) * limit, f.stat().st_size)
                    counting.append(Task(f"{name}-p{k:04d}", (str(f), k * limit, end)))
    lines = runner.run("lines", lines_dir, counting, count_newlines) if counting else None
    tasks = []
    for source, options, f, i, name, how, count, limit in files:
        args = (source["name"], source["kind"], options, str(f), i, str(out), recipe.partition_docs)
        if how is None:
            tasks.append(Task(name, (*args, None)))
            continue
        newlines = None
        if how == "lines":
            ids = [f"{name}-p{k:04d}" for k in range(count - 1)]
            newlines = [task_counts(lines_dir, t)["newlines"] for t in ids]
        for piece in pieces(f, how, count, limit, newlines):
            tasks.append(Task(f"{name}-p{piece.index:04d}", (*args, piece)))
    stats = runner.run("ingest", out, tasks, ingest.ingest_file)
    if lines is not None:
        stats.seconds += lines.seconds
        stats.cpu_seconds += lines.cpu_seconds
    return stats


def _build_tokenizer(recipe: Recipe, runner: Runner) -> StageStats:
    src = _need(recipe, "clean")

    limit = recipe.tokenizer.get("train_mb")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int | float)
                              or limit <= 0):  # fmt: skip
        raise RecipeError(f"recipe {recipe.path}: [tokenizer] train_mb must be > 0, got {limit!r}")
    used = {"bytes": 0}

    def texts():
        """The cleaned documents in partition order, up to `train_mb` MB of text: a
        vocabulary is learnt from a sample (the whole corpus would cost the stage time in
        proportion to the corpus, in one process)."""
        for p in _parts(src):
            for d in read_docs(p):
                if limit is not None and used["bytes"] >= limit * 1e6:
                    return
                used["bytes"] += len(d["text"].encode())
                yield d["text"]

    def build(_):
        tok = build_tokenizer(recipe.tokenizer, texts(), recipe.path.parent)
        atomic_write_bytes(recipe.output / "tokenizer.json", tok.to_str().encode())
        vocab = tok.get_vocab_size(with_added_tokens=True)
        return {"bytes_in": used["bytes"], "extra": {"vocab_size": vocab}}

    return Runner(workers=1, progress=runner.progress).run(
        "tokenizer", recipe.work / "tokenizer", [Task("tokenizer", (None,))], build
    )


def _dedup(recipe: Recipe, runner: Runner) -> StageStats:
    src = _need(recipe, "filter")
    cfg = recipe.dedup
    threshold = float(cfg.get("threshold", 0.7))
    num_perm, n, seed = (
        int(cfg.get("num_perm", 128)),
        int(cfg.get("shingle_words", 2)),
        int(cfg.get("seed", 1)),
    )
    sig_dir = recipe.work / "signatures"
    tasks = [Task(p.stem, (str(p), str(sig_dir / p.name), num_perm, n, seed)) for p in _parts(src)]
    signatures = runner.run("minhash", sig_dir, tasks, dedup.signature_partition)
    groups = dedup.find_duplicates(
        [str(p) for p in _parts(sig_dir)],
        [str(p) for p in _parts(src)],
        str(recipe.work / "lsh"),
        threshold,
        num_perm,
        n,
        runner=runner,
        sources=[s["name"] for s in recipe.sources],  # the survivor order starts with them
    )
    reports = recipe.output / "reports"
    reports.mkdir(parents=True, exist_ok=True)
    clusters = (recipe.work / "lsh" / "clusters.jsonl").read_bytes()
    atomic_write_bytes(reports / "dedup_clusters.jsonl", clusters)
    # Partition k's documents are the nodes k << 32 | row of the grouping (its k-th path).
    removed, out = recipe.work / "lsh" / dedup.REMOVED_NODES, recipe.work / "dedup"
    if not removed.exists():  # lsh/ grouped by an earlier megadata (removed-nodes.arrow)
        raise FileNotFoundError(f"{removed} is missing: delete {removed.parent} to group again")
    removed = str(removed)
    tasks = [
        Task(p.stem, (str(p), str(out / p.name), removed, k)) for k, p in enumerate(_parts(src))
    ]
    stats = runner.run("dedup", out, tasks, dedup.remove_partition)
    stats.extra.update(groups["extra"])
    stats.seconds += signatures.seconds + groups["seconds"]
    stats.cpu_seconds += signatures.cpu_seconds + groups["cpu_seconds"]
    stats.peak_rss_mb = max(stats.peak_rss_mb, signatures.peak_rss_mb, groups["peak_rss_mb"])
    return stats


def _holdout(recipe: Recipe, runner: Runner) -> StageStats:
    """Held-out documents out of the partitions, then the evaluation files made of them."""
    if not recipe.holdout:
        return _map(runner, recipe, "holdout", "dedup", link_partition)
    try:
        cfg = holdout.settings(recipe.holdout)
    except ValueError as e:
        raise RecipeError(f"recipe {recipe.path}: {e}") from None
    unknown = sorted(set(cfg["sources"]) - {s["name"] for s in recipe.sources})
    if unknown:
        raise RecipeError(f"recipe {recipe.path}: [holdout] sources {unknown} are not sources")
    src, work = _need(recipe, "dedup"), recipe.work
    tasks = [
        Task(
            p.stem,
            (
                str(p),
                str(work / "holdout" / p.name),
                str(work / "holdout_docs" / p.name),
                cfg["every"],
                cfg["sources"],
                str(work / "holdout_docs" / f"{p.stem}.eval.json"),
                cfg,
                recipe.sentence_splitter,
            ),
        )
        for p in _parts(src)
    ]
    # The stage's _DONE.json lands in holdout/ last, when the evaluation files are written.
    split = runner.run("holdout", work / "holdout_split", tasks, holdout.split_partition)
    formatted = [str(work / "holdout_docs" / f"{p.stem}.eval.json") for p in _parts(src)]
    eval_dir = str(recipe.output / "eval")
    eval_files = (formatted, eval_dir, cfg, asdict(split), recipe.sentence_splitter)
    stats = Runner(workers=1, progress=runner.progress).run(
        "holdout", work / "holdout", [Task("eval-files", eval_files)], holdout.write_eval_files
    )
    stats.seconds += split.seconds
    stats.cpu_seconds += split.cpu_seconds
    stats.peak_rss_mb = max(stats.peak_rss_mb, split.peak_rss_mb)
    return stats


def _decontaminate(recipe: Recipe, runner: Runner) -> StageStats:
    """Test articles out of the training documents, then the 8-gram overlap report."""
    if not recipe.decontaminate:
        return _map(runner, recipe, "decontaminate", "holdout", link_partition)
    holdout_dir = recipe.output / "eval" if recipe.holdout else None
    try:
        cfg = decontaminate.settings(recipe.decontaminate)
        eval_sets = decontaminate.resolve_eval_sets(cfg, recipe.path.parent, holdout_dir)
    except decontaminate.EvalSetError as e:
        raise RecipeError(f"recipe {recipe.path}: {e}") from None
    src, work = _need(recipe, "holdout"), recipe.work
    prep_dir = str(work / "decontaminate_eval")
    single = Runner(workers=1, progress=runner.progress)
    prepared = single.run(
        "eval sets",
        Path(prep_dir),
        [Task("eval-sets", (eval_sets, prep_dir, cfg))],
        decontaminate.prepare_eval_sets,
    )
    out, found_dir, digest_dir = (
        work / "decontaminate",
        work / "decontaminate_found",
        work / "decontaminate_digests",
    )

    def side(p: Path) -> tuple:
        digests = str(digest_dir / p.name) if cfg["train_bloom"] else None
        return str(found_dir / p.name), digests

    tasks = _partition_tasks(
        src,
        lambda p: (str(p), str(out / p.name), prep_dir, cfg, *side(p)),
    )
    # The stage's _DONE.json lands in decontaminate/ last, when the report is written.
    removal = runner.run(
        "decontaminate", work / "decontaminate_remove", tasks, decontaminate.remove_partition
    )
    steps = [removal, prepared]
    bloom_dir = None
    if cfg["train_bloom"]:  # the reusable filter: one task and one file per shard
        bloom_dir = recipe.output / "reports" / "train_8grams"
        digests = [str(digest_dir / p.name) for p in _parts(src)]
        shard_tasks = [
            Task(f"{k:05d}", (digests, k, str(bloom_dir), cfg)) for k in range(cfg["bloom_shards"])
        ]
        steps.append(
            runner.run(
                "train bloom", work / "decontaminate_bloom", shard_tasks,
                decontaminate.build_bloom_shard,
            )
        )  # fmt: skip
    report = (
        [str(out / p.name) for p in _parts(src)],
        prep_dir,
        str(recipe.output / "reports"),
        cfg,
        asdict(removal),
        [str(found_dir / p.name) for p in _parts(src)],
        None if bloom_dir is None else str(bloom_dir),
    )
    stats = single.run("decontaminate", out, [Task("report", report)], decontaminate.write_report)
    stats.seconds += sum(step.seconds for step in steps)
    stats.cpu_seconds += sum(step.cpu_seconds for step in steps)
    stats.peak_rss_mb = max(step.peak_rss_mb for step in [stats, *steps])
    return stats


def _shard(recipe: Recipe, runner: Runner) -> StageStats:
    src = _need(recipe, "tokenize")
    valid_every = int(recipe.shard.get("valid_every", 30))
    shard_tokens = int(recipe.shard.get("shard_tokens", 1 << 20))
    kind = recipe.tokenizer.get("kind", "gpt2-bpe")

    parts, work = [str(p) for p in _parts(src)], recipe.work / "shard"
    finished = finished_stage(work)
    if finished is not None and not (work / "write").exists():
        return finished  # sharded by an earlier megadata, in one task: nothing redone
    # The shards, in parallel; then the manifest, in this process, last.
    result = shard.write_shards(
        parts, str(recipe.output), valid_every, shard_tokens, str(work), runner
    )

    def build(_):
        from tokenizers import Tokenizer

        tok_path = recipe.output / "tokenizer.json"
        tok = Tokenizer.from_file(str(tok_path))
        stages = [_stage_summary(recipe, s) for s in STAGES[:-1]]
        shard.write_manifest(
            recipe.output,
            {
                "recipe": {"name": recipe.name, "fingerprint": recipe.fingerprint()},
                "tokenizer": {
                    "kind": kind,
                    "file": "tokenizer.json",
                    "sha256": sha256_file(tok_path),
                    "vocab_size": tok.get_vocab_size(with_added_tokens=True),
                    "eod_id": eod_id(tok, kind),
                },
                "token_dtype": str(token_type(tok.get_vocab_size(with_added_tokens=True))),
                "sentence_boundaries": bool(
                    recipe.shard.get("sentence_boundaries", kind == "bert-wordpiece")
                ),
                "split": {"valid_every": valid_every, "by": "sha256(doc_id)"},
                "splits": {
                    s: {**result["counts"][s], "shards": result["shards"][s]}
                    for s in ("train", "valid")
                },
                "stages": stages,
                "cluster_start": _cluster_start_row(recipe),
            },
        )
        c = result["counts"]
        return {
            "docs_in": c["train"]["docs"] + c["valid"]["docs"],
            "docs_out": c["train"]["docs"] + c["valid"]["docs"],
            "tokens": c["train"]["tokens"] + c["valid"]["tokens"],
            "extra": {"train_docs": c["train"]["docs"], "valid_docs": c["valid"]["docs"]},
        }

    stats = Runner(workers=1, progress=runner.progress).run(
        "shard", work, [Task("shard", (None,))], build
    )
    stats.seconds += result["seconds"]
    stats.cpu_seconds += result["cpu_seconds"]
    stats.peak_rss_mb = max(stats.peak_rss_mb, result["peak_rss_mb"])
    return stats


def run_recipe(
    recipe: Recipe,
    workers: int = 2,
    progress: bool = True,
    stages=STAGES,
    scheduler: str | None = None,
) -> list[StageStats]:
    claim_output(recipe)
    results = []
    with Runner(workers, progress, scheduler) as runner:
        record_start(recipe, runner.start())
        for stage in stages:
            results.append(run_stage(recipe, stage, runner))
    return results


def finished_run(recipe: Recipe, stages=STAGES) -> list[StageStats] | None:
    """The recorded rows of a corpus every stage of which is done (its manifest written, by
    this recipe), known without starting a cluster; None when there is work left."""
    claim_output(recipe)
    files = [_stats_file(recipe, stage) for stage in stages]
    if not (recipe.output / "manifest.json").is_file() or not all(f.is_file() for f in files):
        return None
    return [StageStats(**json.loads(f.read_text())) for f in files]


def record_start(recipe: Recipe, start: StageStats | None) -> None:
    """Keep the cluster's start-up (a row of its own, not charged to the first stage) for
    the table and the manifest; a run in one process has none."""
    path = _stats_file(recipe, CLUSTER_START)
    if start is None:
        path.unlink(missing_ok=True)
    else:
        atomic_write_json(path, asdict(start))


def cluster_start(recipe: Recipe) -> StageStats | None:
    """The start-up of the cluster of the latest run, or None."""
    path = _stats_file(recipe, CLUSTER_START)
    return StageStats(**json.loads(path.read_text())) if path.exists() else None
