"""Wikipedia ingest's faster scans give what the plain patterns they replace give: _tidy's
reversed and literal-led patterns, prestrip's str.find bracket counting and its table rows
and list marks found after newlines."""

import random
import re

from megadata.sources import wiki_markup as ingest
from megadata.sources import wiki_prestrip

# ---------------------------------------------------------------- the plain patterns

_PAREN_TAIL = re.compile(r"(?:\s*[,;:])+\s*\)")
_PAREN_EMPTY = re.compile(r"(?:^|[ \t\xa0]+)\(\s*\)", re.M)
_SPACES = re.compile(r"[ \t]{2,}")
_SPACE_BEFORE_PUNCT = re.compile(r"[ \t]+(?=[.,;:](?:\s|$))")


def plain_tidy(text: str) -> str:
    text = ingest._MAGIC_WORD.sub("", re.sub(r"'{2,}", "", text))
    text = ingest._PAREN_LEAD.sub("(", text)
    text = _PAREN_EMPTY.sub("", _PAREN_TAIL.sub(")", text))
    text = _SPACES.sub(" ", text)

    def cut(m):
        at = m.start()
        return "" if at > 0 and re.match(r"\w", text[at - 1]) else m[0]

    text = _SPACE_BEFORE_PUNCT.sub(cut, text)
    lines = [line.strip() for line in text.splitlines()]
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip()


def plain_drop_balanced(text, tokens, opens, wanted=None):
    out, kept_from, depth, start, drop = [], 0, 0, 0, True
    for m in tokens.finditer(text):
        if opens(m):
            if depth == 0:
                start, drop = m.start(), wanted is None or wanted(m)
            depth += 1
        elif depth:
            depth -= 1
            if depth == 0 and drop:
                out.append(text[kept_from:start])
                kept_from = m.end()
    out.append(text[kept_from:])
    return "".join(out)


def plain_prestrip(wikitext: str) -> str:
    w = wiki_prestrip
    text = w._DROPPED_TAG.sub("", w._REF.sub("", w._COMMENT.sub("", wikitext)))
    text = plain_drop_balanced(text, re.compile(r"\{\{|\}\}"), lambda m: m[0] == "{{")
    table_row = re.compile(r"^[ \t]*(\{\||\|\})", re.M)
    text = plain_drop_balanced(text, table_row, lambda m: m[1] == "{|")
    text = plain_drop_balanced(
        text,
        re.compile(r"\[\[|\]\]"),
        lambda m: m[0] == "[[",
        lambda m: w._MEDIA.match(text, m.start()),
    )
    text = w._PLAIN_LINK.sub(w._link_text, text)
    return re.sub(r"^[*#][*#:]*", "", text, flags=re.M)


# ---------------------------------------------------------------- the tests


def test_tidy_equals_the_plain_patterns():
    cases = [
        "Paris (; born 1900; ) was ()\n() here, f() and g( ) stay ,\tyes\xa0() x",
        "a  ,b c , d\t, e\t\t. f _ . g . \n\n\n\n h\u2028 i \r\n j ;",
        "(\n,\n)\n  (  )  ( , ; )\n\t()",
    ]
    rng = random.Random(0)
    alphabet = [
        " ", " ", " ", "\t", "\n", "\n", "\r", "\xa0", "\u2028", "\x0b", "(", ")", ")", ",",
        ";", ":", ".", "'", "''", "_", "a", "1", "é", "__TOC__", "-", "\u3000",
    ]  # fmt: skip
    for _ in range(20000):
        cases.append("".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40))))
    for text in cases:
        assert ingest._tidy(text) == plain_tidy(text), repr(text)


def test_prestrip_equals_the_regex_token_scans():
    cases = [
        "{|\n|a\n|}\nkept {{t|{{u}}}} [[File:x|[[y]] cap]] [[a|b]] [[c]] {{open",
        "  {| x\n* item\n# two\n:def\n {{a}} }} ]] [[b|[[File:c]]]] [[Category:d]]",
        "*# list at the start\n[[File:never closes [[x]]",
    ]
    rng = random.Random(1)
    alphabet = [
        "{{", "}}", "{", "}", "[[", "]]", "[", "]", "|", "{|", "|}", "\n", "\n", " ", "\t", "*",
        "#", ":", "<ref>", "</ref>", "<!--", "-->", "File:", "Image :", "category:", "a", "=",
        "<math>", "</math>", "(",
    ]  # fmt: skip
    for _ in range(20000):
        cases.append("".join(rng.choice(alphabet) for _ in range(rng.randint(0, 60))))
    for text in cases:
        assert wiki_prestrip.prestrip(text) == plain_prestrip(text), repr(text)
