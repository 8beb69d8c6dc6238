"""Corpora in megadata's format (`megacommon.corpus_format`, the writer megadata's shard stage
uses), written directly, for the tests of megatrain and megaeval (megatrain reads files, not
megadata); and `cuda_graphs_on_cpu`, for training with `training.cuda_graphs` on a CPU."""

import contextlib
import json
from pathlib import Path

import numpy as np
import pyarrow as pa

from megacommon import corpus_format
from megacommon.files import atomic_write_json, sha256_file

EOD = 0
VOCAB = 1000
TOKENIZER_SHA = "ab" * 32
# The tiny model of the layout tests (overrides), and their logging: every step, no TensorBoard,
# a fixed peak so that no matrix multiply is timed.
TINY_MODEL = [
    "model.num_layers=4",
    "model.hidden_size=32",
    "model.num_attention_heads=4",
    "model.max_position_embeddings=32",
    "model.hidden_dropout=0.0",
    "model.attention_dropout=0.0",
]
QUIET_LOGGING = ["logging.log_interval=1", "logging.tensorboard=false", "logging.peak_tflops=1.0"]


def short_run(steps: int) -> list[str]:
    """The layout tests' run (overrides): `steps` iterations of 4 microbatches of 2 x 16
    tokens, validated once at the end, quiet logging."""
    return [
        *QUIET_LOGGING,
        "training.seq_length=16",
        "training.micro_batch_size=2",
        "training.global_batch_size=8",
        f"training.train_iters={steps}",
        f"training.eval_interval={steps}",
        "training.eval_iters=1",
        "optimizer.lr=0.003",
        "optimizer.lr_warmup_iters=1",
    ]


def write_corpus(
    root: Path,
    splits: dict[str, list[list[list[int]]]],
    *,
    dtype: str = "uint16",
    kind: str = "gpt2-bpe",
    batch_rows: int = 3,
    vocab_size: int = VOCAB,
    sentence_ends: dict[str, list[list[list[int]]]] | None = None,
    **manifest_overrides,
) -> Path:
    """A corpus directory in megadata's format: splits -> shards -> documents (token lists).

    `sentence_ends`, shaped like `splits` (one list of ends per document), adds the
    column that megadata writes for BERT corpora."""
    root.mkdir(parents=True, exist_ok=True)
    schema = corpus_format.shard_schema(dtype, sentence_ends is not None)
    entries = {}
    for split, shards in splits.items():
        entries[split] = []
        for i, docs in enumerate(shards):
            file = corpus_format.shard_file(split, i)
            data = {"doc_id": [f"{split}-{i}-{r}" for r in range(len(docs))], "tokens": docs}
            if sentence_ends is not None:
                data["sentence_ends"] = sentence_ends[split][i]
            # Several record batches per shard, as megadata writes large shards.
            table = pa.table(data, schema=schema)
            shard = corpus_format.write_shard(root / file, table, batch_rows)
            entries[split].append({"file": file, **shard})
    fields = {
        "tokenizer": {
            "eod_id": EOD,
            "file": "tokenizer.json",
            "kind": kind,
            "sha256": TOKENIZER_SHA,
            "vocab_size": vocab_size,
        },
        "token_dtype": dtype,
        "sentence_boundaries": sentence_ends is not None,
        **manifest_overrides,
    }
    corpus_format.write_manifest(root, splits=entries, **fields)
    return root


def random_documents(rng, count: int, vocab_size: int, low: int, high: int) -> list[list[int]]:
    """`count` documents of random ids in [1, vocab_size), between low and high tokens, + EOD."""
    return [
        [*rng.integers(1, vocab_size, rng.integers(low, high)).tolist(), EOD] for _ in range(count)
    ]


def counting_documents(rng, count: int, vocab_size: int) -> list[list[int]]:
    """`count` counting sequences (a random start and step, 12 to 59 ids in [1, vocab_size)),
    each + EOD: learnable, not memorizable."""
    docs = []
    for _ in range(count):
        start, step, n = rng.integers(1, vocab_size), rng.integers(1, 5), rng.integers(12, 60)
        docs.append([int(1 + (start + i * step) % (vocab_size - 1)) for i in range(n)] + [EOD])
    return docs


def write_counting_corpus(root: Path, vocab_size: int, seed: int = 0) -> Path:
    """A corpus of `counting_documents`: three train shards of 60, a valid shard of 30."""
    rng = np.random.default_rng(seed)
    splits = {
        "train": [counting_documents(rng, 60, vocab_size) for _ in range(3)],
        "valid": [counting_documents(rng, 30, vocab_size)],
    }
    return write_corpus(root, splits, vocab_size=vocab_size)


def write_newer_checkpoint(ckpt: Path, field: str, version: str | None) -> Path:
    """A checkpoint as a megatrain of `version` (None: one that recorded none) whose run
    config has `field` ("section.name", a field this megatrain lacks) writes it: `latest`,
    meta.json and a tokenizer of its vocabulary, no tensors (a reader refuses it first)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    from megatrain.checkpoint.files import FORMAT_VERSION
    from megatrain.config import Config

    directory = Path(ckpt) / "iter_0000001"
    directory.mkdir(parents=True)
    vocab = {"<eod>": 0, "<unk>": 1, "the": 2, "cat": 3}
    Tokenizer(WordLevel(vocab, unk_token="<unk>")).save(str(directory / "tokenizer.json"))
    config = Config().to_dict()
    section, name = field.split(".")
    config.setdefault(section, {})[name] = 1
    meta = {
        "format_version": FORMAT_VERSION,
        "iteration": 1,
        "vocab_size": len(vocab),
        "padded_vocab_size": 128,
        "tokenizer": {"eod_id": 0, "sha256": sha256_file(directory / "tokenizer.json")},
        "config": config,
        "files": {"tokenizer.json": (directory / "tokenizer.json").stat().st_size},
    }
    if version is not None:
        meta["megatrain_version"] = version
    atomic_write_json(directory / "meta.json", meta)
    (Path(ckpt) / "latest").write_text(directory.name + "\n")
    return Path(ckpt)


def write_text_corpus(root: Path, texts: list[str], vocab_size: int = 300, valid_every: int = 5):
    """A corpus of real text with a real byte-level BPE tokenizer.json (EOD = "<|endoftext|>")
    trained on it, for tests that encode and decode: (root, tokenizer)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer)
    eod = tok.token_to_id("<|endoftext|>")
    docs = [[*tok.encode(t).ids, eod] for t in texts]
    splits = {
        "train": [[d for i, d in enumerate(docs) if i % valid_every]],
        "valid": [[d for i, d in enumerate(docs) if not i % valid_every]],
    }
    root.mkdir(parents=True, exist_ok=True)
    tok.save(str(root / "tokenizer.json"))
    size = tok.get_vocab_size(with_added_tokens=True)
    write_corpus(root, splits, vocab_size=size)
    manifest = json.loads((root / "manifest.json").read_text())
    manifest["tokenizer"].update(eod_id=eod, sha256=sha256_file(root / "tokenizer.json"))
    atomic_write_json(root / "manifest.json", manifest)
    return root, tok


def grammar_texts(n: int, seed: int = 0) -> list[str]:
    """Documents of a small grammar ("the cat sat on the mat."), so a tiny model learns
    something in a few steps."""
    import numpy as np

    rng = np.random.default_rng(seed)
    verbs = {"cat": "sat", "dog": "ran", "bird": "flew"}
    out = []
    for _ in range(n):
        sentences = []
        for _ in range(rng.integers(3, 7)):
            subject = str(rng.choice(list(verbs)))
            place = rng.choice(["mat", "tree", "roof"])
            sentences.append(f"the {subject} {verbs[subject]} on the {place}.")
        out.append(" ".join(sentences))
    return out


BERT_SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]  # megadata's, in its order
STDLIB_MODULES = (
    "argparse", "subprocess", "difflib", "doctest", "pickle", "typing", "statistics", "csv",
    "shutil", "logging", "unittest", "json", "textwrap", "string", "collections", "functools",
)  # fmt: skip


def english_texts(min_chars: int = 400) -> list[str]:
    """Real English that ships with Python, written by its authors: the docstrings of the
    public functions and classes of a few standard-library modules."""
    import importlib
    import inspect
    import warnings

    texts, seen = [], set()
    for name in STDLIB_MODULES:
        module = importlib.import_module(name)
        for attr in sorted(dir(module)):
            if attr.startswith("_"):
                continue
            with warnings.catch_warnings():  # typing.io and typing.re warn when touched
                warnings.simplefilter("ignore", DeprecationWarning)
                obj = getattr(module, attr)
                doc = "" if inspect.ismodule(obj) else inspect.getdoc(obj) or ""
            if len(doc) >= min_chars and doc not in seen:
                seen.add(doc)
                texts.append(doc)
    return texts


def write_bert_text_corpus(
    root: Path, texts: list[str], vocab_size: int = 1000, valid_every: int = 5, **kwargs
):
    """A bert-wordpiece corpus of real text as megadata's tokenize stage writes it: a
    lowercase WordPiece tokenizer.json trained on the texts, sentences split by pysbd
    (megadata's splitter), documents ending with [SEP] and their `sentence_ends`.
    Returns (root, tokenizer, sentences: per split and shard, each document's
    sentences as token lists); `kwargs` go to `write_corpus`."""
    import pysbd
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    trainer = trainers.WordPieceTrainer(
        vocab_size=vocab_size, special_tokens=BERT_SPECIALS, show_progress=False
    )
    tok.train_from_iterator(texts, trainer=trainer)
    # The trainer numbers tokens of equal counts in a different order from run to run: ids by
    # sorted token (specials first), so a test's corpus and model are the same every run.
    learned = tok.get_vocab()
    order = [*BERT_SPECIALS, *sorted(t for t in learned if t not in BERT_SPECIALS)]
    tok.model = models.WordPiece({t: i for i, t in enumerate(order)}, unk_token="[UNK]")
    sep = tok.token_to_id("[SEP]")
    segmenter = pysbd.Segmenter(language="en", clean=False)
    docs, ends, sentences = [], [], []
    for text in texts:
        pieces = [s for s in (p.strip() for p in segmenter.segment(text)) if s]
        encoded = [e.ids for e in tok.encode_batch(pieces, add_special_tokens=False)]
        seq, bounds = [], []
        for ids in encoded:
            seq += ids
            bounds.append(len(seq))
        docs.append([*seq, sep])
        ends.append(bounds)
        sentences.append(encoded)

    def split(items):
        return {
            "train": [[x for i, x in enumerate(items) if i % valid_every]],
            "valid": [[x for i, x in enumerate(items) if not i % valid_every]],
        }

    root.mkdir(parents=True, exist_ok=True)
    tok.save(str(root / "tokenizer.json"))
    size = tok.get_vocab_size(with_added_tokens=True)
    write_corpus(
        root,
        split(docs),
        kind="bert-wordpiece",
        vocab_size=size,
        sentence_ends=split(ends),
        **kwargs,
    )
    manifest = json.loads((root / "manifest.json").read_text())
    manifest["tokenizer"].update(eod_id=sep, sha256=sha256_file(root / "tokenizer.json"))
    atomic_write_json(root / "manifest.json", manifest)
    return root, tok, split(sentences)


def assert_same_steps(run: dict, reference: dict, name: str, tol: float) -> None:
    """Two `train` results took the same steps: losses and the last validation loss within
    `tol`, gradient norms within `tol` relative, the validation at the same iteration."""
    assert len(run["loss"]) == len(reference["loss"]), (name, run["loss"], reference["loss"])
    for a, b in zip(run["loss"], reference["loss"], strict=True):
        assert abs(a - b) < tol, (name, run["loss"], reference["loss"])
    for a, b in zip(run["grad_norm"], reference["grad_norm"], strict=True):
        assert abs(a - b) < tol * b, (name, run["grad_norm"], reference["grad_norm"])
    (it, valid), (ref_it, ref_valid) = run["valid"][-1], reference["valid"][-1]
    assert it == ref_it and abs(valid - ref_valid) < tol, name


@contextlib.contextmanager
def cuda_graphs_on_cpu():
    """`training.cuda_graphs` on any device: megacore's emulation of make_graphed_callables
    (static inputs, outputs and gradients, NaN warm-up gradients) stands in for the capture,
    and the CUDA-only check lets the run through.  The GPU check runs the real capture."""
    from megacore.testing.cuda_graphs import emulate_make_graphed_callables
    from megatrain import parallelize
    from megatrain.parallelize import cuda_graphs

    saved = cuda_graphs.make_graphed_callables, parallelize.check_cuda_graphs
    cuda_graphs.make_graphed_callables = emulate_make_graphed_callables
    parallelize.check_cuda_graphs = lambda device: None
    try:
        yield
    finally:
        cuda_graphs.make_graphed_callables, parallelize.check_cuda_graphs = saved


@contextlib.contextmanager
def world_of_one(rendezvous: Path):
    """A gloo process group of this process alone (rendezvous through the file `rendezvous`),
    with megacore's groups at tp = pp = 1, for tests that train, load or convert in-process
    without a spawn; a group already there is used and left alone."""
    import torch.distributed as dist

    from megacore import parallel_state as ps

    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"file://{rendezvous}")
    try:
        yield
    finally:
        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
        if created:
            dist.destroy_process_group()
