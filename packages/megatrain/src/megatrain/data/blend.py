"""Weighted blends of corpora, as pretraining runs compose their data (Megatron-LM's
`--data-path 0.3 wiki 0.7 web` and its BlendedDataset).

`data.blend = [[0.3, "data/corpus/wiki"], [0.7, "data/corpus/news"]]` in a run config takes
the place of `data.corpus`; the weights are normalised. Global sample k of the blend is
chosen by Megatron-LM's blending rule: at sample n every corpus d has drawn c_d samples so
far, and the one whose deficit w_d * max(n, 1) - c_d is largest (the first of equals) gives
its next sample, c_d. That sample is the corpus's own global sample c_d in the paper's
order (`GPTBatches.sample`, or BERT's), so a corpus is cycled over as many epochs as its
weight needs, each epoch reshuffled. The realised shares stay within one sample of the
weights at every n for two corpora; the rule compares the counts with w * n before sample n
is drawn, so with three or more a share can run up to ~1.4 samples off (measured over random
weights, tests/test_blend.py). The rule is Megatron-LM's to the sample, so a blend here reads
its corpora in the order Megatron-LM's BlendedDataset would.

The rule is sequential, so the blend keeps the counts at its position (`consumed_samples`,
the start of the current global batch) and works out one global batch at a time from them:
O(global batch x corpora) per iteration, the same on every rank, and independent of the
layout (a rank takes its slice of the global samples as `SampleBatches` does for one
corpus). The counts are part of the saved data position, so a resumed run continues the
blend exactly without replaying it from the start.

Every corpus of a blend must share one tokenizer (the manifests' tokenizer sha256, kind,
vocabulary size and end-of-document id); one corpus (`data.corpus`) is read as before,
without this wrapper.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from megatrain.config import DEFAULT_CORPUS, Config, check_blend
from megatrain.data.corpus import Corpus, open_run_corpus
from megatrain.data.samples import SampleBatches


@dataclass(frozen=True)
class BlendEntry:
    """One corpus of a run's data: its name in the logs, its normalised weight, its path, and
    the config field that names it (for messages)."""

    name: str
    weight: float
    path: str
    field: str


def _entries(pairs: list[tuple[float, str]], field: str) -> list[BlendEntry]:
    total = sum(w for w, _ in pairs)
    names = [Path(p).name or p for _, p in pairs]
    if len(set(names)) < len(names):  # two directories of one name: the paths tell them apart
        names = [p for _, p in pairs]
    return [
        BlendEntry(n, w / total, p, field if field == "data.corpus" else f"{field}[{i}]")
        for i, (n, (w, p)) in enumerate(zip(names, pairs, strict=True))
    ]


def run_blend(config: Config, split: str) -> list[BlendEntry]:
    """The corpora a run reads for `split` ("train" or "valid"), with their weights:
    `data.valid_blend` for valid when set, else `data.blend`, else the one `data.corpus`."""
    d = config.data
    if split == "valid" and d.valid_blend is not None:
        return _entries(check_blend(d.valid_blend, "data.valid_blend"), "data.valid_blend")
    if d.blend is not None:
        return _entries(check_blend(d.blend, "data.blend"), "data.blend")
    return _entries([(1.0, d.corpus or DEFAULT_CORPUS)], "data.corpus")


@dataclass
class OpenBlend:
    """The corpora of one split of a run, opened and checked against each other."""

    entries: list[BlendEntry]
    corpora: list[Corpus]

    @property
    def first(self) -> Corpus:
        """The corpus whose tokenizer the run records (all of a blend share it)."""
        return self.corpora[0]

    @property
    def is_blend(self) -> bool:
        return len(self.corpora) > 1


TOKENIZER_FIELDS = ("sha256", "kind", "vocab_size", "eod_id")


def open_run_blend(config: Config, split: str, verify: bool | None = None) -> OpenBlend:
    """Open every corpus of the run's `split` (each checked as `open_run_corpus` checks one),
    refusing corpora whose tokenizers differ, naming both files and their sha256."""
    entries = run_blend(config, split)
    corpora = []
    for e in entries:
        try:
            corpora.append(open_run_corpus(config, split, verify, path=e.path))
        except (FileNotFoundError, ValueError) as error:
            if e.field == "data.corpus":
                raise
            raise type(error)(f"{e.field}: {error}") from None
    first, first_tok = corpora[0], corpora[0].manifest.get("tokenizer", {})
    for entry, corpus in zip(entries[1:], corpora[1:], strict=True):
        tok = corpus.manifest.get("tokenizer", {})
        for name in TOKENIZER_FIELDS:
            if tok.get(name) != first_tok.get(name):
                raise ValueError(
                    f"data blend: the corpora do not share one tokenizer: "
                    f"{corpus.path / 'tokenizer.json'} (sha256 {tok.get('sha256')}) and "
                    f"{first.path / 'tokenizer.json'} (sha256 {first_tok.get('sha256')}) "
                    f"differ in tokenizer.{name} ({tok.get(name)!r} against "
                    f"{first_tok.get(name)!r}); build every corpus of a blend with one "
                    "tokenizer (a recipe's [tokenizer] tokenizer_json can name another "
                    f"corpus's tokenizer.json), or leave {entry.path} out"
                )
    return OpenBlend(entries, corpora)


def blend_block(
    weights: np.ndarray, counts: np.ndarray, start: int, size: int
) -> tuple[np.ndarray, np.ndarray]:
    """Megatron-LM's blending rule for global samples [start, start + size), from `counts`
    (samples drawn from each corpus before `start`, advanced in place): the corpus of each
    sample and its index among that corpus's samples."""
    corpus = np.empty(size, np.int64)
    index = np.empty(size, np.int64)
    for i in range(size):
        deficit = weights * max(start + i, 1) - counts
        d = int(np.argmax(deficit))  # the first of equals, as Megatron-LM's helper
        corpus[i], index[i] = d, counts[d]
        counts[d] += 1
    return corpus, index


class BlendedBatches(SampleBatches):
    """Microbatches of one data-parallel rank over a weighted blend of corpora: the slicing
    and position of `SampleBatches`, the samples of each corpus's own sampler (`sources`,
    GPTBatches or BertBatches, used for `sample` and `collate` only)."""

    def __init__(
        self,
        entries: list[BlendEntry],
        sources: list[SampleBatches],
        global_batch_size: int,
        micro_batch_size: int,
        dp_rank: int = 0,
        dp_size: int = 1,
    ):
        self.entries = entries
        self.sources = sources
        self.weights = np.array([e.weight for e in entries], np.float64)
        first = sources[0]
        super().__init__(
            first.corpus,
            first.seq_len,
            first.seed,
            global_batch_size,
            micro_batch_size,
            dp_rank,
            dp_size,
        )
        self.samples_per_epoch = sum(s.samples_per_epoch for s in sources)

    def reset(self) -> None:
        super().reset()
        self._counts = np.zeros(len(self.entries), np.int64)  # at consumed_samples
        self._block: tuple[int, np.ndarray, np.ndarray, np.ndarray] | None = None

    def _batch(self) -> tuple[np.ndarray, np.ndarray]:
        """Corpus and per-corpus index of the global batch at `consumed_samples`."""
        start = self.consumed_samples
        if self._block is not None and self._block[0] != start:
            begun, _, _, after = self._block
            if start != begun + self.global_batch_size:
                raise RuntimeError(f"blend position moved from {begun} to {start} unexpectedly")
            self._counts, self._block = after, None
        if self._block is None:
            after = self._counts.copy()
            corpus, index = blend_block(self.weights, after, start, self.global_batch_size)
            self._block = (start, corpus, index, after)
        return self._block[1], self._block[2]

    def sample(self, k: int) -> Any:
        corpus, index = self._batch()
        i = k - self.consumed_samples
        return self.sources[int(corpus[i])].sample(int(index[i]))

    def collate(self, samples: list[Any]) -> dict[str, np.ndarray]:
        return self.sources[0].collate(samples)

    def drawn(self) -> dict[str, int]:
        """Samples drawn from each corpus by all ranks before `consumed_samples`."""
        counts = self._counts
        if self._block is not None and self._block[0] != self.consumed_samples:
            counts = self._block[3]  # the batch just finished
        return {e.name: int(c) for e, c in zip(self.entries, counts, strict=True)}

    def log_fields(self) -> dict[str, Any]:
        return {"blend_samples": self.drawn()}

    def describe(self, total_samples: int) -> str:
        """What `total_samples` global samples take from each corpus, in epochs."""
        # The rule keeps every count within about a sample of its share: no need to replay it.
        parts = []
        for e, s in zip(self.entries, self.sources, strict=True):
            share = e.weight * total_samples
            parts.append(
                f"{e.name} {e.weight:.1%} (~{share:.0f} samples, "
                f"{share / s.samples_per_epoch:.2f} epochs of its {s.samples_per_epoch})"
            )
        return f"blend of {len(self.entries)} corpora over {total_samples} samples: " + "; ".join(
            parts
        )

    def data_identity(self) -> dict[str, Any]:
        parts = zip(self.entries, self.sources, strict=True)
        text = json.dumps([[e.name, e.weight, s._fingerprint] for e, s in parts])
        return {
            "split": self.corpus.split,
            "corpus_docs": sum(s.corpus.num_docs for s in self.sources),
            "corpus_tokens": sum(s.corpus.num_tokens for s in self.sources),
            "corpus_fingerprint": hashlib.sha256(text.encode()).hexdigest(),
        }

    def identity(self) -> dict[str, Any]:
        return {
            "blend": [[e.name, e.weight] for e in self.entries],
            **{f"source_{k}": v for k, v in self.sources[0].identity().items()},
        }

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state["blend_counts"] = list(self.drawn().values())
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        counts = np.asarray(state.get("blend_counts", ()), np.int64)
        if counts.shape != (len(self.entries),) or counts.sum() != self.consumed_samples:
            raise ValueError(
                f"data position state: blend_counts {state.get('blend_counts')!r} do not add "
                f"up to consumed_samples {self.consumed_samples} over {len(self.entries)} "
                "corpora; the state is damaged"
            )
        self._counts, self._block = counts, None
