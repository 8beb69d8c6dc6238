"""WikiText103 perplexity as the Megatron-LM paper computes it (its Appendix E.1).

T_o words are counted on the raw test file; the file is detokenized, encoded
once into T tokens, and scored by windows of `seq_len` tokens whose starts
advance by `stride`, so every one of the T - 1 targets is scored once with at
least `seq_len - stride` tokens of context. The adjusted perplexity normalises
the summed loss by the T_o - 1 word-level targets instead of the T - 1 tokens.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass

import numpy as np

from megacommon.progress import progress_bar
from megaeval.errors import EvalDataError, EvalSettingsError
from megaeval.scoring import Scorer


def read_wikitext(path: str | os.PathLike) -> str:
    """The raw text of a wiki.test.tokens-style file, as bytes decoded (no newline rewriting)."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise EvalDataError(f"{path}: no such file")
    if not os.path.isfile(path):
        raise EvalDataError(f"{path}: not a file")
    with open(path, "rb") as f:
        raw = f.read()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise EvalDataError(f"{path}: not UTF-8 text (byte {e.start})") from None
    if not text.strip():
        raise EvalDataError(f"{path}: empty file (expected WikiText token text)")
    return text


def count_raw_tokens(text: str) -> int:
    """T_o: the paper's word count, splitting on single spaces (so line breaks count too)."""
    return len(text.strip().split(" "))


# The reversible WikiText detokenizer used for GPT-2 evaluation. Order matters: the
# number marks and punctuation spacing go before the bracket rules, the heading
# rules before the line-edge spaces. The published T = 270329 depends on every rule.
_BEFORE_BRACKETS = [
    ("s '", "s'"),  # plural possessive: "players ' club" -> "players' club"
    (" @-@ ", "-"),
    (" @,@ ", ","),
    (" @.@ ", "."),
    (" : ", ": "),
    (" ; ", "; "),
    (" . ", ". "),
    (" ! ", "! "),
    (" ? ", "? "),
    (" , ", ", "),
]
# Each pair of delimiters is re-attached to the (shortest) content between them. Single
# quotes pair up with apostrophes too ("the keepers ' cottage ... the ' Old Light '" loses
# the wrong spaces); the paper's detokenizer does the same, and its T counts on it.
_BRACKETS = [
    (re.compile(r"\(\s*([^\)]*?)\s*\)"), r"(\1)"),
    (re.compile(r"\[\s*([^\]]*?)\s*\]"), r"[\1]"),
    (re.compile(r"\{\s*([^\}]*?)\s*\}"), r"{\1}"),
    (re.compile(r"\"\s*([^\"]*?)\s*\""), r'"\1"'),
    (re.compile(r"'\s*([^']*?)\s*'"), r"'\1'"),
]
_AFTER_BRACKETS = [
    ("= = = =", "===="),  # headings, longest first
    ("= = =", "==="),
    ("= =", "=="),
    (" \N{DEGREE SIGN} ", "\N{DEGREE SIGN}"),
    (" \n", "\n"),
    ("\n ", "\n"),
    (" N ", " 1 "),  # the corpus writes some numbers as N
    (" 's", "'s"),
]


def detokenize(text: str) -> str:
    """Undo WikiText's tokenization artifacts (spaces around punctuation, @-@ marks, ...)."""
    for old, new in _BEFORE_BRACKETS:
        text = text.replace(old, new)
    for pattern, replacement in _BRACKETS:
        text = pattern.sub(replacement, text)
    for old, new in _AFTER_BRACKETS:
        text = text.replace(old, new)
    return text


@dataclass(frozen=True)
class Window:
    """One model call: input tokens[begin:end] predict targets tokens[begin + 1 : end + 1].

    Only targets at token positions score_from .. end are counted; earlier ones
    were scored by a previous window with more context.
    """

    begin: int
    end: int
    score_from: int


def check_window_settings(seq_len: int, stride: int, max_seq_len: int | None = None) -> None:
    """Refuse a window length or stride the evaluation cannot use, naming the flag."""
    if seq_len < 1:
        raise EvalSettingsError(f"--seq-len must be at least 1, got {seq_len}")
    if max_seq_len is not None and seq_len > max_seq_len:
        raise EvalSettingsError(
            f"--seq-len {seq_len} is longer than the model's {max_seq_len} positions"
        )
    if not 1 <= stride <= seq_len:
        raise EvalSettingsError(f"--stride must be between 1 and --seq-len {seq_len}, got {stride}")


def windows(num_tokens: int, seq_len: int, stride: int) -> list[Window]:
    """The paper's sliding windows over `num_tokens` tokens (targets 1 .. num_tokens - 1).

    The first window scores all its targets; window k starts at k * stride and
    scores only the targets past the previous window's last one, each with at
    least seq_len - stride tokens of context.
    """
    check_window_settings(seq_len, stride)
    last_target = num_tokens - 1
    if last_target < 1:
        return []
    result = [Window(0, min(seq_len, last_target), 1)]
    begin = 0
    while result[-1].end < last_target:
        begin += stride
        end = min(begin + seq_len, last_target)
        result.append(Window(begin, end, result[-1].end + 1))
    return result


def _exp(x: float) -> float:
    return math.exp(x) if x < 700 else math.inf


def evaluate_wikitext(
    scorer: Scorer,
    data_path: str | os.PathLike,
    seq_len: int = 1024,
    stride: int = 32,
    batch_size: int = 8,
    progress: bool = True,
) -> dict:
    """Perplexity and adjusted perplexity of `scorer` on a WikiText test file (JSON-able)."""
    check_window_settings(seq_len, stride, scorer.max_seq_len)
    if batch_size < 1:
        raise EvalSettingsError(f"--batch-size must be at least 1, got {batch_size}")
    raw = read_wikitext(data_path)
    num_raw = count_raw_tokens(raw)
    tokens = scorer.encode(detokenize(raw))
    if len(tokens) < 2:
        raise EvalDataError(f"{data_path}: fewer than 2 tokens after encoding, nothing to score")
    plan = windows(len(tokens), seq_len, stride)

    total_nll = 0.0  # a Python float: a float64 sum
    scored = 0
    bar = progress_bar(len(plan), "wikitext103", "window", enabled=progress and scorer.is_main)
    for first in range(0, len(plan), batch_size):
        batch = plan[first : first + batch_size]
        results = scorer.score([tokens[w.begin : w.end + 1] for w in batch])
        for window, result in zip(batch, results, strict=True):
            # Entry i of the window's scores is target position window.begin + 1 + i.
            counted = result.nll[window.score_from - window.begin - 1 :]
            total_nll += float(np.sum(counted, dtype=np.float64))
            scored += len(counted)
        bar.update(len(batch))
    bar.close()
    if scored != len(tokens) - 1:  # the window arithmetic guarantees it; a scorer might not
        raise RuntimeError(f"scored {scored} targets, expected {len(tokens) - 1}")

    mean_loss = total_nll / scored
    return {
        "data": os.fspath(data_path),
        "T_o": num_raw,
        "T": len(tokens),
        "targets": scored,
        "mean_loss": mean_loss,
        "ppl": _exp(mean_loss),
        # The loss per word-level target: the number comparable with word-level models.
        "adjusted_ppl": _exp(mean_loss * (len(tokens) - 1) / max(num_raw - 1, 1)),
        "seq_len": seq_len,
        "stride": stride,
        "windows": len(plan),
    }
