"""The fine-tuning tasks of the paper's Table 5: data, inputs, head, metrics and Table 6's
hyperparameters.

Inputs, as Megatron's tasks built them (WordPiece ids of the checkpoint's tokenizer):

- MNLI, QQP: [CLS] A [SEP] B [SEP], token types 0 then 1, the longer text cut first when
  the pair exceeds `max_seq_length` (128 by default).
- RACE: for each of the 4 options, [CLS] question+option [SEP] passage [SEP] (a question
  with a "_" blank gets the option in the blank, else the option follows the question);
  the passage, not the question, is cut to fit (512 by default).
- SQuAD 1.1/2.0: `megaeval.finetune.squad` (windows of the context, 384 / stride 128).

Table 6 (batch size, learning rate, epochs) is given per model size (336M, 1.3B, 3.8B); a
checkpoint of another size takes the row nearest its parameter count (printed).
"""

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from megaeval.finetune import metrics, readers
from megaeval.finetune.model import CHOICES

# Table 6: task -> model size -> (batch size, learning rate, epochs).
TABLE6 = {
    "mnli": {"336m": (128, 1e-5, 10), "1.3b": (128, 1e-5, 10), "3.8b": (128, 1e-5, 10)},
    "qqp": {"336m": (128, 5e-5, 12), "1.3b": (128, 3e-5, 12), "3.8b": (256, 4e-5, 12)},
    "squad1": {"336m": (64, 3e-5, 2), "1.3b": (48, 3e-5, 2), "3.8b": (48, 1e-5, 2)},
    "squad2": {"336m": (48, 3e-5, 2), "1.3b": (64, 3e-5, 2), "3.8b": (48, 1e-5, 2)},
    "race": {"336m": (32, 2e-5, 3), "1.3b": (16, 1e-5, 3), "3.8b": (32, 2e-5, 3)},
}
SIZES = {"336m": 336e6, "1.3b": 1.3e9, "3.8b": 3.8e9}


def table6_row(task: str, parameters: int) -> tuple[str, tuple[int, float, int]]:
    """The Table 6 row of the size nearest `parameters` (by ratio): (size, (batch, lr, epochs))."""
    size = min(SIZES, key=lambda s: abs(math.log(parameters / SIZES[s])))
    return size, TABLE6[task][size]


@dataclass
class Features:
    """A split as model inputs: arrays [n, sequences per example, s] and labels per example
    ([n], or [n, 2] start/end for spans; None for unlabelled test data)."""

    tokens: np.ndarray
    token_types: np.ndarray
    padding_mask: np.ndarray
    labels: np.ndarray | None
    ids: list  # the example id of each feature (several SQuAD windows share one)
    extra: object = None  # what scoring needs beside the logits (SQuAD's windows)

    def __len__(self) -> int:
        return len(self.tokens)


@dataclass(frozen=True)
class Task:
    name: str
    head: str  # model.HEADS
    num_classes: int
    max_seq_length: int
    train_split: str
    eval_splits: tuple[str, ...]


TASKS = {
    "mnli": Task("mnli", "classify", 3, 128, "train", ("dev_matched", "dev_mismatched")),
    "qqp": Task("qqp", "classify", 2, 128, "train", ("dev",)),
    "race": Task("race", "choice", CHOICES, 512, "train", ("dev", "test")),
    "squad1": Task("squad1", "span", 2, 384, "train", ("dev",)),
    "squad2": Task("squad2", "span", 2, 384, "train", ("dev",)),
}
LABEL_NAMES = {
    "mnli": {i: name for name, i in readers.MNLI_LABELS.items()},
    "qqp": {i: str(i) for i in (0, 1)},
    "race": {i: name for name, i in readers.RACE_LABELS.items()},
}
SQUAD_FILES = {"squad1": ("train-v1.1.json", "dev-v1.1.json"),
               "squad2": ("train-v2.0.json", "dev-v2.0.json")}  # fmt: skip


class Special:
    """The ids of [CLS], [SEP] and [PAD] in a WordPiece tokenizer, refused when absent."""

    def __init__(self, tokenizer):
        ids = {t: tokenizer.token_to_id(t) for t in ("[CLS]", "[SEP]", "[PAD]")}
        missing = [t for t, i in ids.items() if i is None]
        if missing:
            raise ValueError(
                f"--ckpt: the checkpoint's tokenizer has no {', '.join(missing)} (fine-tuning "
                "needs BERT's WordPiece tokens)"
            )
        self.cls, self.sep, self.pad = ids["[CLS]"], ids["[SEP]"], ids["[PAD]"]


def _encode(tokenizer, texts: list[str]) -> list[list[int]]:
    return [e.ids for e in tokenizer.encode_batch(texts, add_special_tokens=False)]


def pack_pair(a: list[int], b: list[int], length: int, special: Special, cut_b_only=False):
    """[CLS] a [SEP] b [SEP] padded to `length`: (tokens, token types, padding mask); the
    longer of a and b loses its last token until the pair fits (only b with `cut_b_only`)."""
    a, b = list(a), list(b)
    while len(a) + len(b) > length - 3:
        if cut_b_only or len(b) >= len(a):
            if not b:
                a.pop()
            else:
                b.pop()
        else:
            a.pop()
    ids = [special.cls, *a, special.sep, *b, special.sep]
    types = [0] * (len(a) + 2) + [1] * (len(b) + 1)
    pad = length - len(ids)
    return ids + [special.pad] * pad, types + [0] * pad, [True] * len(ids) + [False] * pad


def _stack(rows: list[tuple], per_example: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    tokens, types, mask = (np.asarray([r[i] for r in rows]) for i in range(3))
    s = tokens.shape[-1]
    return (
        tokens.reshape(-1, per_example, s).astype(np.int64),
        types.reshape(-1, per_example, s).astype(np.int64),
        mask.reshape(-1, per_example, s).astype(bool),
    )


def pair_features(examples, tokenizer, length: int) -> Features:
    special = Special(tokenizer)
    a = _encode(tokenizer, [e.text_a for e in examples])
    b = _encode(tokenizer, [e.text_b for e in examples])
    rows = [pack_pair(x, y, length, special) for x, y in zip(a, b, strict=True)]
    tokens, types, mask = _stack(rows, 1)
    labelled = all(e.label is not None for e in examples)
    labels = np.asarray([e.label for e in examples], np.int64) if labelled else None
    return Features(tokens, types, mask, labels, [e.uid for e in examples])


def race_question(question: str, option: str) -> str:
    """The option in the question's blank ("_"), or after the question."""
    return question.replace("_", option, 1) if "_" in question else f"{question} {option}"


def race_features(examples, tokenizer, length: int) -> Features:
    special = Special(tokenizer)
    passages = _encode(tokenizer, [e.article for e in examples])
    queries = _encode(
        tokenizer, [race_question(e.question, o) for e in examples for o in e.options]
    )
    rows = [
        pack_pair(queries[i * CHOICES + j], passages[i], length, special, cut_b_only=True)
        for i in range(len(examples))
        for j in range(CHOICES)
    ]
    tokens, types, mask = _stack(rows, CHOICES)
    labels = np.asarray([e.label for e in examples], np.int64)
    return Features(tokens, types, mask, labels, [e.id for e in examples], extra=examples)


def read_split(task: Task, data: Path, split: str):
    """The examples of a split and the reader's problems (printed by the caller)."""
    if task.name == "mnli":
        return readers.read_mnli(data, split)
    if task.name == "qqp":
        return readers.read_qqp(data, split)
    if task.name == "race":
        return readers.read_race(data, split)
    train, dev = SQUAD_FILES[task.name]
    version = {"squad1": "1.1", "squad2": "2.0"}[task.name]  # for files that carry none
    return readers.read_squad(Path(data) / (train if split == "train" else dev), version=version)


def features(task: Task, examples, tokenizer, length: int, training: bool) -> Features:
    if task.name in ("mnli", "qqp"):
        return pair_features(examples, tokenizer, length)
    if task.name == "race":
        return race_features(examples, tokenizer, length)
    from megaeval.finetune import squad

    # A window holds [CLS] question [SEP] context [SEP], the question cut to 64 tokens.
    longest = max((len(q) for q in _encode(tokenizer, [e.question for e in examples])), default=0)
    query = min(longest, squad.MAX_QUERY_LENGTH)
    if length - query - 3 < 1:
        raise ValueError(
            f"--max-seq-length {length} leaves no room for the context after the longest "
            f"question ({query} tokens): pass --max-seq-length {query + 4} or more"
        )
    feats = squad.squad_features(examples, tokenizer, max_seq_length=length, is_training=training)
    tokens = np.asarray([f.input_ids for f in feats], np.int64)[:, None]
    types = np.asarray([f.token_type_ids for f in feats], np.int64)[:, None]
    mask = np.asarray([f.padding_mask for f in feats], bool)[:, None]
    # Evaluation windows have no positions: (0, 0) stands in (scoring reads the logits only).
    labels = np.asarray([(f.start_position or 0, f.end_position or 0) for f in feats], np.int64)
    return Features(tokens, types, mask, labels, [f.example_id for f in feats], (examples, feats))


def score(task: Task, split: str, feats: Features, logits: np.ndarray) -> tuple[dict, dict]:
    """(metrics, predictions by example id) of a split from the model's logits per feature,
    computed as the official scripts compute them."""
    if task.head != "span":
        predicted = logits.argmax(-1).tolist()
        names = LABEL_NAMES[task.name]  # predictions in the official label names
        predictions = {i: names[p] for i, p in zip(feats.ids, predicted, strict=True)}
        if feats.labels is None:
            return {}, predictions
        labels = feats.labels.tolist()
        if task.name == "mnli":
            result = {"accuracy": metrics.accuracy(predicted, labels)}
        elif task.name == "qqp":
            result = metrics.qqp_metrics(predicted, labels)
        else:
            levels = [e.level for e in feats.extra]
            result = metrics.race_accuracy(predicted, labels, levels)
        return result, predictions
    from megaeval.finetune import squad

    examples, windows = feats.extra
    if task.name == "squad1":
        predictions, _ = squad.squad_predictions(examples, windows, logits[..., 0], logits[..., 1])
        return metrics.squad_v1_evaluate(examples, predictions), predictions
    # SQuAD 2.0 as the official evaluation: the best non-null answers with their null-score
    # differences, the no-answer threshold chosen on this split (best F1), then applied.
    best, na_probs = squad.squad_predictions(
        examples,
        windows,
        logits[..., 0],
        logits[..., 1],
        version_2=True,
        null_score_diff_threshold=math.inf,
    )
    result = metrics.squad_v2_evaluate(examples, best, na_probs, na_prob_thresh=0.0)
    threshold = result.get("best_f1_thresh", 0.0)
    result["null_threshold"] = threshold
    return result, squad.apply_null_threshold(best, na_probs, threshold)
