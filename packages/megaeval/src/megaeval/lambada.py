"""LAMBADA cloze accuracy as the Megatron-LM paper computes it (its Appendix E.2).

Each example is a passage whose last word the model must predict from the rest.
On the raw (OpenAI lambada_test.jsonl) text, strict mode encodes the context and
' ' + last word separately and counts an example correct only if every subword
token of the last word is the model's argmax under teacher forcing. Non-strict
mode encodes the whole passage and predicts its last token only.
"""

from __future__ import annotations

import json
import math
import os
import sys

import numpy as np

from megacommon.progress import progress_bar
from megaeval.errors import EvalDataError, EvalSettingsError
from megaeval.scoring import Scorer


def read_lambada(path: str | os.PathLike) -> list[str]:
    """The passages of a jsonl file of `{"text": ...}` objects; blank lines are skipped."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise EvalDataError(f"{path}: no such file")
    if not os.path.isfile(path):
        raise EvalDataError(f"{path}: not a file")
    texts = []
    with open(path, encoding="utf-8") as f:
        try:
            lines = f.readlines()
        except UnicodeDecodeError:
            raise EvalDataError(f"{path}: not UTF-8 text") from None
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise EvalDataError(f"{where}: not JSON ({e.msg})") from None
        if not isinstance(record, dict) or "text" not in record:
            raise EvalDataError(f'{where}: expected an object with a "text" field')
        text = record["text"]
        if not isinstance(text, str) or not text.strip():
            raise EvalDataError(f'{where}: "text" must be a non-empty string')
        if len(text.split()) < 2:
            raise EvalDataError(f'{where}: "text" has one word, so no context to predict it from')
        texts.append(text)
    if not texts:
        raise EvalDataError(f'{path}: empty file (expected one {{"text": ...}} object per line)')
    return texts


def split_last_word(text: str) -> tuple[str, str]:
    """(context, last word): the context is the text before the last word, without its spaces."""
    text = text.strip()
    last_word = text.split()[-1]
    return text[: len(text) - len(last_word)].rstrip(), last_word


def example_tokens(scorer: Scorer, text: str, strict: bool) -> tuple[list[int], int]:
    """The tokens of one example and how many of them, at the end, are targets."""
    if strict:
        context, last_word = split_last_word(text)
        target = scorer.encode(" " + last_word)
        return scorer.encode(context) + target, len(target)
    return scorer.encode(text.strip()), 1


def evaluate_lambada(
    scorer: Scorer,
    data_path: str | os.PathLike,
    strict: bool = True,
    batch_size: int = 8,
    progress: bool = True,
) -> dict:
    """Cloze accuracy and last-word perplexity of `scorer` on a LAMBADA jsonl file (JSON-able)."""
    if batch_size < 1:
        raise EvalSettingsError(f"--batch-size must be at least 1, got {batch_size}")
    texts = read_lambada(data_path)
    examples = []
    truncated = 0
    longest = scorer.max_seq_len + 1  # the model reads all but the last token
    for text in texts:
        tokens, num_targets = example_tokens(scorer, text, strict)
        if len(tokens) <= num_targets:
            raise EvalDataError(f"{data_path}: {text[:40]!r}... encodes to no context tokens")
        if num_targets >= longest:
            raise EvalDataError(
                f"{data_path}: a last word of {num_targets} tokens does not fit the model's "
                f"{scorer.max_seq_len} positions"
            )
        if len(tokens) > longest:
            tokens = tokens[-longest:]  # keep the context nearest the last word
            truncated += 1
        examples.append((tokens, num_targets))
    if truncated and scorer.is_main:
        print(
            f"lambada: {truncated} of {len(examples)} contexts are longer than the model's "
            f"{scorer.max_seq_len} positions; their first tokens were dropped",
            file=sys.stderr,
        )

    correct = 0
    target_tokens = 0
    total_nll = 0.0  # a Python float: a float64 sum
    bar = progress_bar(len(examples), "lambada", "example", enabled=progress and scorer.is_main)
    for first in range(0, len(examples), batch_size):
        batch = examples[first : first + batch_size]
        results = scorer.score([tokens for tokens, _ in batch])
        for (_, num_targets), result in zip(batch, results, strict=True):
            # Teacher forcing: the last num_targets predictions are the target tokens.
            correct += bool(np.all(result.correct[-num_targets:]))
            total_nll += float(np.sum(result.nll[-num_targets:], dtype=np.float64))
            target_tokens += num_targets
        bar.update(len(batch))
    bar.close()

    target_loss = total_nll / target_tokens
    return {
        "data": os.fspath(data_path),
        "examples": len(examples),
        "correct": correct,
        "accuracy": correct / len(examples),
        "target_tokens": target_tokens,
        "target_loss": target_loss,
        "target_ppl": math.exp(target_loss) if target_loss < 700 else math.inf,
        "strict": strict,
        "truncated": truncated,
    }
