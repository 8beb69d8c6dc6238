"""Clean: fix unicode (ftfy), keep English (langdetect), undo artificial line breaks per source.

langdetect draws random numbers; with `DetectorFactory.seed` fixed it gives the
same answer for the same text in every process, so the corpus is reproducible.
The line-break fix (the paper's CC-Stories problem) joins lines inside a
paragraph for the sources the recipe names; a blank line still ends a paragraph.
"""

import re
from pathlib import Path

import ftfy

from megadata.documents import read_docs, text_bytes, write_docs

_PARAGRAPH = re.compile(r"\n\s*\n")
_SPACES = re.compile(r"[ \t]+")


def join_broken_lines(text: str) -> str:
    paragraphs = _PARAGRAPH.split(text)
    return "\n\n".join(_SPACES.sub(" ", p.replace("\n", " ")).strip() for p in paragraphs)


def english_probability(text: str, seed: int, chars: int = 2000) -> float:
    from langdetect import DetectorFactory, detect_langs
    from langdetect.lang_detect_exception import LangDetectException

    DetectorFactory.seed = seed
    try:
        langs = detect_langs(text[:chars])
    except LangDetectException:  # no letters at all
        return 0.0
    return next((lang.prob for lang in langs if lang.lang == "en"), 0.0)


def clean_partition(in_path: str, out_path: str, options: dict) -> dict:
    lang_threshold = float(options.get("min_english_prob", 0.9))
    seed = int(options.get("seed", 0))
    join_sources = set(options.get("join_lines_sources", []))
    kept, extra, bytes_in = [], {"not_english": 0, "empty": 0}, 0
    n = 0
    for doc in read_docs(Path(in_path)):
        n += 1
        bytes_in += len(doc["text"].encode())
        text = ftfy.fix_text(doc["text"])
        if doc["source"] in join_sources:
            text = join_broken_lines(text)
        text = text.strip()
        if not text:
            extra["empty"] += 1
            continue
        if lang_threshold > 0 and english_probability(text, seed) < lang_threshold:
            extra["not_english"] += 1
            continue
        kept.append({**doc, "text": text})
    write_docs(Path(out_path), kept)
    return {
        "docs_in": n,
        "docs_out": len(kept),
        "bytes_in": bytes_in,
        "bytes_out": text_bytes(kept),
        "extra": extra,
    }
