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

from megacommon import corpus_format
from megacommon.files import atomic_write_bytes, atomic_write_json, sha256_file
from megadata import __version__
from megadata.documents import link_partition, read_docs
from megadata.encode import DEFAULT_SPLITTER, check_splitter
from megadata.file_pieces import count_newlines, how_to_split, pieces, split_bytes
from megadata.runner import Runner, StageStats, Task, finished_stage, task_counts
from megadata.settings import TOP_LEVEL, PositiveInt, RecipeError, check_keys, load
from megadata.sources.options import SOURCE_KEYS, SOURCE_KINDS, SourceOptions, options_table
from megadata.stages import clean, decontaminate, dedup, filter, holdout, ingest, shard, tokenize
from megadata.stages.clean import CleanSettings
from megadata.stages.decontaminate import DecontaminateSettings
from megadata.stages.dedup import DedupSettings
from megadata.stages.filter import FilterSettings
from megadata.stages.holdout import HoldoutSettings
from megadata.stages.shard import ShardSettings
from megadata.tokenizer import TokenizerSettings, bos_id, build_tokenizer, eod_id

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

CLUSTER_START = "cluster-start"  # its row in _work/_stats/


@dataclass(frozen=True)
class TopLevel:
    """A recipe's own keys, and its sections as the tables they are (each is loaded into
    its stage's settings: SECTIONS)."""

    name: str
    sources: list[dict]  # [[sources]] tables: megadata.sources.options
    output: str | None = None  # relative to the recipe file; None: corpus-NAME beside it
    partition_docs: PositiveInt = 500
    sentence_splitter: str = DEFAULT_SPLITTER  # megadata.encode: BERT's sentence ends, LAMBADA
    clean: dict = field(default_factory=dict)
    tokenizer: dict = field(default_factory=dict)
    filter: dict = field(default_factory=dict)
    dedup: dict = field(default_factory=dict)
    holdout: dict = field(default_factory=dict)
    decontaminate: dict = field(default_factory=dict)
    shard: dict = field(default_factory=dict)

    def __post_init__(self):
        check_splitter(self.sentence_splitter)


# Each section of a recipe and the settings of the stage that owns it.  A recipe without
# [holdout] or [decontaminate] (or with it empty) skips that stage's work.
SECTIONS = {
    "clean": CleanSettings,
    "tokenizer": TokenizerSettings,
    "filter": FilterSettings,
    "dedup": DedupSettings,
    "holdout": HoldoutSettings,
    "decontaminate": DecontaminateSettings,
    "shard": ShardSettings,
}
OPTIONAL_SECTIONS = ("holdout", "decontaminate")


@dataclass
class Recipe:
    name: str
    path: Path
    output: Path
    sources: list[dict]  # the [[sources]] tables, their keys checked (their options: at ingest)
    clean: CleanSettings = field(default_factory=CleanSettings)
    tokenizer: TokenizerSettings = field(default_factory=TokenizerSettings)
    filter: FilterSettings = field(default_factory=FilterSettings)
    dedup: DedupSettings = field(default_factory=DedupSettings)
    holdout: HoldoutSettings | None = None
    decontaminate: DecontaminateSettings | None = None
    shard: ShardSettings = field(default_factory=ShardSettings)
    partition_docs: int = 500
    sentence_splitter: str = DEFAULT_SPLITTER  # megadata.encode: BERT's sentence ends, LAMBADA
    raw: dict = field(default_factory=dict)  # the file's tables as read: its fingerprint

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
    # Every key and value is checked here (a source's options: when ingest starts), so a
    # misspelt key or a value of the wrong type is refused before any stage runs.
    where = f"recipe {path}: "
    for key in ("name", "sources"):
        if key not in raw:
            raise RecipeError(f"recipe {path}: missing '{key}'")
    top = load(TopLevel, raw, TOP_LEVEL, where)
    names = [s.get("name") for s in top.sources]
    if len(set(names)) != len(names):
        raise RecipeError(f"recipe {path}: source names must be unique (doc ids start with them)")
    for i, s in enumerate(top.sources):
        for key in SOURCE_KEYS:
            if key not in s:
                raise RecipeError(f"recipe {path}: sources[{i}] has no '{key}'")
        if s["kind"] not in SOURCE_KINDS:
            raise RecipeError(
                f"recipe {path}: sources[{i}].kind is {s['kind']!r}; expected one of {SOURCE_KINDS}"
            )
        check_keys(SourceOptions, options_table(s), f"source {s['name']!r}", where)
    sections = {}
    for name, settings in SECTIONS.items():
        table = getattr(top, name)
        if name in OPTIONAL_SECTIONS and not table:
            sections[name] = None
        else:
            sections[name] = load(settings, table, f"[{name}]", where)
    if output is not None:  # from the command line: relative to the working directory
        out = Path(output).absolute()  # absolute: tasks may run on other machines
    else:  # from the recipe: relative to the recipe file
        out = (
            path.parent / (top.output if top.output is not None else f"corpus-{top.name}")
        ).resolve()
    return Recipe(
        name=top.name,
        path=path,
        output=out,
        sources=top.sources,
        partition_docs=top.partition_docs,
        sentence_splitter=top.sentence_splitter,
        raw=raw,
        **sections,
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
    if stage not in STAGE_RUNS:
        raise RecipeError(f"unknown stage {stage!r}; stages are {', '.join(STAGES)}")
    return STAGE_RUNS[stage](recipe, runner)


def _sentence_boundaries(recipe: Recipe) -> bool:
    """Whether the corpus keeps sentence ends: [shard] sentence_boundaries, by default a
    BERT corpus's."""
    if recipe.shard.sentence_boundaries is not None:
        return recipe.shard.sentence_boundaries
    return recipe.tokenizer.kind == "bert-wordpiece"


def _clean(recipe: Recipe, runner: Runner) -> StageStats:
    return _map(runner, recipe, "clean", "ingest", clean.clean_partition, recipe.clean)


def _filter(recipe: Recipe, runner: Runner) -> StageStats:
    _need(recipe, "tokenizer")
    work, tokenizer_path = recipe.work, str(recipe.output / "tokenizer.json")
    sentences, splitter = _sentence_boundaries(recipe), recipe.sentence_splitter
    src, out, kept = _need(recipe, "clean"), work / "filter", work / "filter_tokens"
    head = (tokenizer_path, recipe.filter.min_tokens)
    tasks = _partition_tasks(
        src,
        lambda p: (str(p), str(out / p.name), *head, str(kept / p.name), sentences, splitter),
    )
    return runner.run("filter", out, tasks, filter.filter_partition)


def _tokenize(recipe: Recipe, runner: Runner) -> StageStats:
    from tokenizers import Tokenizer

    work, tokenizer_path = recipe.work, str(recipe.output / "tokenizer.json")
    tok = Tokenizer.from_file(tokenizer_path)
    eod, bos = eod_id(tok, recipe.tokenizer), bos_id(tok, recipe.tokenizer)
    sentences, splitter = _sentence_boundaries(recipe), recipe.sentence_splitter
    src, out = _need(recipe, "decontaminate"), work / "tokenize"
    kept, head = work / "filter_tokens", (tokenizer_path, eod, sentences)
    tasks = _partition_tasks(
        src,
        lambda p: (str(p), str(out / p.name), *head, str(kept / p.name), splitter, bos),
    )
    return runner.run("tokenize", out, tasks, tokenize.tokenize_partition)


def _ingest(recipe: Recipe, runner: Runner) -> StageStats:
    """A task per input file, or per piece of a large one (megadata.file_pieces), whose line
    numbers come from a first stage that counts the newlines of the pieces."""
    out, files, counting = recipe.work / "ingest", [], []
    lines_dir = out / "_lines"
    finished = finished_stage(out)
    if finished is not None and not lines_dir.exists():  # no file was cut in pieces
        return finished  # (or an earlier megadata ingested them): nothing to count again
    for source in recipe.sources:
        where, label = f"recipe {recipe.path}: ", f"source {source['name']!r}"
        options = load(SourceOptions, options_table(source), label, where)
        limit = split_bytes(options)
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

    limit = recipe.tokenizer.train_mb
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
        text = tok.to_str().encode()
        if recipe.tokenizer.tokenizer_json is not None:
            # Another corpus's (or a converted) tokenizer.json: its bytes kept as they are
            # when the recipe changed nothing in it, so corpora built with one tokenizer
            # carry the same sha256 and can be blended; where it came from is recorded.
            from tokenizers import Tokenizer

            source = (recipe.path.parent / recipe.tokenizer.tokenizer_json).resolve()
            given = source.read_bytes()
            if Tokenizer.from_str(given.decode()).to_str().encode() == text:
                text = given
            origin = {"file": str(source), "sha256": hashlib.sha256(given).hexdigest()}
            atomic_write_json(_tokenizer_source(recipe), origin)
        else:
            _tokenizer_source(recipe).unlink(missing_ok=True)  # of an earlier recipe
        atomic_write_bytes(recipe.output / "tokenizer.json", text)
        vocab = tok.get_vocab_size(with_added_tokens=True)
        return {"bytes_in": used["bytes"], "extra": {"vocab_size": vocab}}

    return Runner(workers=1, progress=runner.progress).run(
        "tokenizer", recipe.work / "tokenizer", [Task("tokenizer", (None,))], build
    )


def _dedup(recipe: Recipe, runner: Runner) -> StageStats:
    src = _need(recipe, "filter")
    cfg = recipe.dedup
    threshold, num_perm, n, seed = float(cfg.threshold), cfg.num_perm, cfg.shingle_words, cfg.seed
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
    cfg = recipe.holdout
    unknown = sorted(set(cfg.sources) - {s["name"] for s in recipe.sources})
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
                cfg.every,
                cfg.sources,
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
    cfg = recipe.decontaminate
    try:
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
        digests = str(digest_dir / p.name) if cfg.train_bloom else None
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
    if cfg.train_bloom:  # the reusable filter: one task and one file per shard
        bloom_dir = recipe.output / "reports" / "train_8grams"
        digests = [str(digest_dir / p.name) for p in _parts(src)]
        shard_tasks = [
            Task(f"{k:05d}", (digests, k, str(bloom_dir), cfg)) for k in range(cfg.bloom_shards)
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


def _tokenizer_source(recipe: Recipe) -> Path:
    """Where the tokenizer stage records the file it took the tokenizer from."""
    return recipe.work / "tokenizer" / "source.json"


def _shard(recipe: Recipe, runner: Runner) -> StageStats:
    src = _need(recipe, "tokenize")
    valid_every, shard_tokens = recipe.shard.valid_every, recipe.shard.shard_tokens
    kind = recipe.tokenizer.kind

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
        origin = _tokenizer_source(recipe)
        vocab_size = tok.get_vocab_size(with_added_tokens=True)
        corpus_format.write_manifest(
            recipe.output,
            tokenizer={
                "kind": kind,
                "file": "tokenizer.json",
                "sha256": sha256_file(tok_path),
                "vocab_size": vocab_size,
                "eod_id": eod_id(tok, recipe.tokenizer),
                # Only when documents start with one, so other manifests keep their bytes.
                **({"bos_id": bos} if (bos := bos_id(tok, recipe.tokenizer)) is not None else {}),
                # The file it was taken from, when the recipe named one (tokenizer_json).
                **({"source": json.loads(origin.read_text())} if origin.is_file() else {}),
            },
            token_dtype=corpus_format.token_dtype(vocab_size),
            sentence_boundaries=_sentence_boundaries(recipe),
            splits=result["shards"],
            recipe={"name": recipe.name, "fingerprint": recipe.fingerprint()},
            split={"valid_every": valid_every, "by": "sha256(doc_id)"},
            stages=stages,
            cluster_start=_cluster_start_row(recipe),
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


# The stages in their order, each with what runs it.
STAGE_RUNS = {
    "ingest": _ingest,
    "clean": _clean,
    "tokenizer": _build_tokenizer,
    "filter": _filter,
    "dedup": _dedup,
    "holdout": _holdout,
    "decontaminate": _decontaminate,
    "tokenize": _tokenize,
    "shard": _shard,
}
STAGES = tuple(STAGE_RUNS)


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
