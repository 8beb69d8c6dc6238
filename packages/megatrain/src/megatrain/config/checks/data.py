"""[data]: the blends' shape and weights (`check_blend`, which megatrain.data.blend
reads a run's blend with), the packed-document switches and BERT's masking.  The
corpora themselves are opened by preflight.
"""

import math
import os
from typing import Any

from megatrain.config.errors import ConfigError
from megatrain.config.sections import PACKING_SWITCHES, Config


def check_blend(value: Any, field: str) -> list[tuple[float, str]]:
    """The (weight, corpus) pairs of a `data.blend` / `data.valid_blend` value, checked
    without touching the filesystem (ConfigError naming the field otherwise)."""
    example = '[[0.3, "data/corpus/wiki"], [0.7, "data/corpus/news"]]'
    if not isinstance(value, list) or not value:
        raise ConfigError(
            f"{field}: expected a non-empty list of [weight, corpus] pairs, e.g. {example}"
        )
    pairs: list[tuple[float, str]] = []
    seen: dict[str, int] = {}
    for i, entry in enumerate(value):
        if (
            not isinstance(entry, list)
            or len(entry) != 2
            or isinstance(entry[0], bool)
            or not isinstance(entry[0], (int, float))
            or not isinstance(entry[1], str)
        ):
            raise ConfigError(
                f"{field}[{i}]: expected a [weight, corpus] pair (a number and a directory), "
                f"got {entry!r}; e.g. {example}"
            )
        weight, path = float(entry[0]), entry[1]
        if not math.isfinite(weight) or weight <= 0:
            raise ConfigError(
                f"{field}[{i}]: the weight of {path!r} is {entry[0]!r}; weights must be "
                "positive numbers (leave a corpus out by removing its pair)"
            )
        key = os.path.realpath(path)
        if key in seen:
            raise ConfigError(
                f"{field}[{i}]: corpus {path!r} is listed twice (also {field}[{seen[key]}]); "
                "give each corpus once, with the sum of its weights"
            )
        seen[key] = i
        pairs.append((weight, path))
    return pairs


def _check_data(config: Config) -> None:
    """The blends' shape and weights (the corpora themselves are opened by preflight)."""
    d = config.data
    if d.blend is not None and d.corpus is not None:
        raise ConfigError(
            f"data.blend and data.corpus are both set (corpus {d.corpus!r}); a blend names all "
            "the corpora a run reads: add the corpus to data.blend, or drop data.blend"
        )
    for name in ("blend", "valid_blend"):
        if getattr(d, name) is not None:
            check_blend(getattr(d, name), f"data.{name}")
    packing = [n for n in PACKING_SWITCHES if getattr(d, n)]
    if not packing:
        return
    m, t = config.model, config.training
    if m.kind == "bert":
        raise ConfigError(
            f"data.{packing[0]} = true with model.kind = 'bert': the packed-document switches are "
            "for causal models (GPT, Llama); a BERT sample is one sentence pair already"
        )
    if t.cuda_graphs:
        raise ConfigError(
            f"data.{packing[0]} = true with training.cuda_graphs = true: a captured layer takes "
            "its hidden states only, not the batch's positions and documents; turn one off"
        )
    if d.eod_mask_loss and t.fused_linear_cross_entropy:
        raise ConfigError(
            "data.eod_mask_loss = true with training.fused_linear_cross_entropy = true: the fused "
            "loss is the mean over every token; turn the fused loss off to mask the EOD positions"
        )


def _check_masking(config: Config) -> None:
    """BERT's sample making: the masked fraction, the n-gram length, short sequences."""
    d = config.data
    if not 0 < d.masked_lm_prob < 1:
        raise ConfigError(f"data.masked_lm_prob must be in (0, 1), got {d.masked_lm_prob}")
    if not d.max_ngram >= 1:
        raise ConfigError(f"data.max_ngram must be >= 1, got {d.max_ngram}")
    if not 0 <= d.short_seq_prob <= 1:
        raise ConfigError(f"data.short_seq_prob must be in [0, 1], got {d.short_seq_prob}")
