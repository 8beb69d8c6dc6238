"""Plain documents -> WikiText-103's raw format (`wiki.test.tokens`), and that format split back.

WikiText-103 (Merity et al. 2016) is Wikipedia text tokenized by the Moses tokenizer, one
paragraph a line, with three marks of its own.  The layout of the real files, which this
module reproduces:

    ␠
    ␠= Robert Boulter =␠
    ␠
    ␠Robert Boulter is an English film , television and theatre actor . He had a guest @-@␠...
    ␠He was cast in the 2005 theatre productions of the Harold Pinter play Celebration .␠
    ␠
    ␠= = Career = =␠
    ␠
    ␠In 2000 Boulter had a role as " Craig " in the episode " Teddy 's Story " .␠

(␠ is a space.)  Every line starts and ends with a space, a blank line is a single space;
an article opens with its title as ` = Title = ` between blank lines, a section heading is
` = = Heading = = ` between blank lines, and paragraphs follow one another without blank
lines.  Inside a line, words and punctuation are separated by single spaces (`word , word .`,
`Teddy 's`, `( 2000 )`, `" Craig "`), a hyphen inside a word is ` @-@ `, and a comma or point
between digits is ` @,@ ` / ` @.@ ` (`1 @,@ 000`, `3 @.@ 5`).  The file used in training is
not tokenized this way, so the reader of this file (megaeval's detokenizer) undoes it.

Tokenizing is Moses' own (sacremoses, with its aggressive dash splitting that makes `@-@`);
only the two digit marks are added here.  Section headings are recognised in our Wikipedia
text (the ingest stage leaves a heading as a short line of its own) by a heuristic: a line
of at most 8 words, capitalised, without closing punctuation, opening a block of lines.
A document without a title gets one from its first words.
"""

import functools
import re
from collections.abc import Iterable

_DIGIT_COMMA = re.compile(r"(?<=\d),(?=\d)")
_DIGIT_POINT = re.compile(r"(?<=\d)\.(?=\d)")
_SPACES = re.compile(r"\s+")
_CLOSING = tuple(".,;:!?\"')]}")
TITLE_WORDS = 6  # words of the text that title a document without one


@functools.cache
def _moses():
    from sacremoses import MosesTokenizer

    moses = MosesTokenizer(lang="en")
    # sacremoses builds a set of every lower-case letter (every letter) on each call of
    # `islower` (`isanyalpha`), once per word before a full stop: the same tests against
    # one set each are 10x cheaper.
    lower, alpha = frozenset(moses.IsLower), frozenset(moses.IsAlpha)
    moses.islower = lambda text: not set(text).difference(lower)
    moses.isanyalpha = lambda text: any(set(text).intersection(alpha))
    return moses


def tokenize(text: str) -> str:
    """One line of plain text in WikiText's tokenization (no leading or trailing space)."""
    text = _SPACES.sub(" ", text).strip()
    if not text:
        return ""
    tokens = _moses().tokenize(text, aggressive_dash_splits=True, escape=False, return_str=True)
    tokens = _DIGIT_POINT.sub(" @.@ ", _DIGIT_COMMA.sub(" @,@ ", tokens))
    return _SPACES.sub(" ", tokens).strip()


def title_from_text(text: str, words: int = TITLE_WORDS) -> str:
    """A title for a document that has none: its first words, without closing punctuation."""
    first = " ".join(text.split()[:words])
    return first.rstrip("".join(_CLOSING)) or first


def _is_heading(line: str) -> bool:
    words = line.split()
    return (
        0 < len(words) <= 8
        and line[0].isupper()
        and not line.endswith(_CLOSING)
        and "|" not in line
    )


def paragraphs(text: str) -> list[tuple[str, str]]:
    """The document as ("heading" | "paragraph", plain text) pieces, in order.

    A heading is a short capitalised line without closing punctuation that opens a block
    (a run of lines between blank lines) and is not the document's last line.
    """
    pieces = []
    for block in re.split(r"\n\s*\n", text.replace("\r\n", "\n")):
        lines = [line.strip() for line in block.split("\n") if line.strip()]
        for i, line in enumerate(lines):
            kind = "heading" if i == 0 and _is_heading(line) else "paragraph"
            pieces.append((kind, line))
    if pieces and pieces[-1][0] == "heading":
        pieces[-1] = ("paragraph", pieces[-1][1])
    return pieces


def format_article(title: str, text: str) -> str:
    """One article in WikiText's layout; '' for a document with no text."""
    lines = []
    for kind, plain in paragraphs(text):
        tokens = tokenize(plain)
        if not tokens:
            continue
        if kind == "heading":
            lines += [" ", f" = = {tokens} = = ", " "]
        else:
            lines.append(f" {tokens} ")
    if not lines:
        return ""
    heading = tokenize(title.strip() or title_from_text(text))
    return "\n".join([" ", f" = {heading} = ", " ", *lines]) + "\n"


def format_articles(articles: Iterable[tuple[str, str]]) -> str:
    """(title, text) pairs -> the contents of a `wiki.test.tokens` file."""
    return "".join(format_article(title, text) for title, text in articles)


def is_title_line(line: str) -> bool:
    """` = Title = ` (an article starts), not ` = = Section = = `."""
    s = line.strip()
    return len(s) > 4 and s.startswith("= ") and s.endswith(" =") and not s.startswith("= =")


def split_articles(wikitext: str) -> list[tuple[str, str]]:
    """A WikiText file -> (title, body) per article, split at its ` = Title = ` lines.

    The title is as written (still tokenized); text before the first title, if any, is an
    article with the title ''.
    """
    articles: list[tuple[str, list[str]]] = []
    for line in wikitext.splitlines():
        if is_title_line(line):
            articles.append((line.strip()[2:-2].strip(), []))
        else:
            if not articles:
                articles.append(("", []))
            articles[-1][1].append(line)
    return [
        (title, "\n".join(body).strip())
        for title, body in articles
        if title or "".join(body).strip()
    ]
