"""The prose of a Wikipedia article's wikitext, markup stripped with mwparserfromhell:
templates, tables, references, file/image links with their captions, category and
interlanguage links, headings of sections left empty and the parentheses they leave empty
(`Paris (; born ...)`) are removed (most of them by a scan before the parser:
megadata.sources.wiki_prestrip)."""

import functools
import re

from megadata.sources.wiki_prestrip import prestrip

_DROPPED_TAGS = frozenset(
    {
        "ref",
        "references",
        "table",
        "gallery",
        "imagemap",
        "timeline",
        "graph",
        "score",
        "math",
        "chem",
        "ce",
        "templatedata",
        "includeonly",
        "inputbox",
        "categorytree",
        "section",
        "mapframe",
        "maplink",
    }
)
_DROPPED_NAMESPACES = frozenset({"file", "image", "media", "category"})
_LANGUAGE_PREFIX = re.compile(r"[a-z]{2,3}(?:-[a-z0-9]+)*|simple")
_MAGIC_WORD = re.compile(r"__[A-Z]+__")
# Patterns open with a literal of two characters or more where they can: the regex engine
# then jumps from one occurrence of it to the next, where a pattern that opens with a
# character class (or with a repeat of one) is tried at every character of that class.
_STYLE_QUOTES = re.compile(r"'''*")  # two quotes or more: italics, bold
_PAREN_LEAD = re.compile(r"\((?:\s*[,;:])+\s*")  # "(; born" -> "(born"
# The two below run on the text reversed, so that they open with the ")" (a literal) rather
# than with the spaces before it: reversed, "(born 1900; )" is ") ;0091 nrob(".
# "(born 1900; )" -> "(born 1900)": the run of spaces and [,;:] before a ")" if it holds one
# of [,;:] (what r"(?:\s*[,;:])+\s*\)" matches, forwards).
_PAREN_TAIL_REVERSED = re.compile(r"\)\s*[,;:][\s,;:]*")
# "Paris ()" -> "Paris": a "()" with the spaces before it, or one that opens a line; f() stays
# (what r"(?:^|[ \t\xa0]+)\(\s*\)" with re.M matches, forwards).
_PAREN_EMPTY_REVERSED = re.compile(r"\)\s*\((?:[ \t\xa0]+|$)", re.M)
_SPACES = re.compile(r"[ \t]{2,}")
_SPACES_NO_TAB = re.compile(r"   *")  # the same, where the text has no tab
# A space (or tab) between a word character and a [.,;:] that ends a word ("born , in"), the
# word character found by a look-behind once the space is (a look-behind that opened the
# pattern would be tried at every character).  One character of space is enough: _SPACES
# has collapsed the runs.
_SPACE_BEFORE_PUNCT = re.compile(r"[ \t](?<=\w[ \t])[.,;:](?=\s|$)")
_SPACE_BEFORE_PUNCT_NO_TAB = re.compile(r" (?<=\w )[.,;:](?=\s|$)")  # a literal: faster
_BLANK_LINES = re.compile("\n\n\n\n*")  # three newlines or more


@functools.cache
def _mw_nodes():
    """mwparserfromhell.nodes, imported on first use (as the parser is) and once: an import
    statement in a function that runs for every node costs more than the test it serves."""
    from mwparserfromhell import nodes

    return nodes


def _unwanted(node, nodes) -> bool:
    if isinstance(node, nodes.Template | nodes.Comment):
        return True
    if isinstance(node, nodes.Tag):
        return str(node.tag).strip().lower() in _DROPPED_TAGS
    if isinstance(node, nodes.Wikilink):
        title = str(node.title).strip()
        if title.startswith(":") or ":" not in title:  # [[:Category:X]] is a visible link
            return False
        prefix = title.split(":", 1)[0].strip()
        if prefix.lower() in _DROPPED_NAMESPACES:  # with the caption: thumb|left|alt=...|text
            return True
        return node.text is None and _LANGUAGE_PREFIX.fullmatch(prefix) is not None
    return False


def _prune(code) -> None:
    """Unwanted nodes out of `code` and of everything inside what stays."""
    nodes = _mw_nodes()
    kept = []
    for node in code.nodes:
        # Most nodes are plain text: never unwanted, nothing inside.
        if type(node) is not nodes.Text:
            if _unwanted(node, nodes):
                continue
            for child in node.__children__():
                _prune(child)
        kept.append(node)
    code.nodes = kept


def _drop_empty_sections(code) -> None:
    """Headings whose section (subsections included) has no text left."""
    from mwparserfromhell.wikicode import Wikicode

    heading = _mw_nodes().Heading
    nodes = code.nodes
    heads = [i for i, node in enumerate(nodes) if isinstance(node, heading)]
    if not heads:
        return
    has_text: dict[int, bool] = {}  # by node index: found only where a section asks

    def text_at(j: int) -> bool:
        if j not in has_text:
            node = nodes[j]
            has_text[j] = not isinstance(node, heading) and bool(
                _MAGIC_WORD.sub("", Wikicode([node]).strip_code()).strip()
            )
        return has_text[j]

    empty = set()
    for h, i in enumerate(heads):
        level = nodes[i].level
        end = next((j for j in heads[h + 1 :] if nodes[j].level <= level), len(nodes))
        if not any(text_at(j) for j in range(i + 1, end)):  # stops at the first text
            empty.add(i)
    code.nodes = [node for i, node in enumerate(nodes) if i not in empty]


def _tidy(text: str) -> str:
    text = _MAGIC_WORD.sub("", _STYLE_QUOTES.sub("", text))
    text = _PAREN_LEAD.sub("(", text)
    reversed_text = _PAREN_TAIL_REVERSED.sub(")", text[::-1])
    text = _PAREN_EMPTY_REVERSED.sub("", reversed_text)[::-1]
    tab = "\t" in text
    text = (_SPACES if tab else _SPACES_NO_TAB).sub(" ", text)
    before_punct = _SPACE_BEFORE_PUNCT if tab else _SPACE_BEFORE_PUNCT_NO_TAB
    text = _cut_out(text, [m.start() for m in before_punct.finditer(text)])
    text = "\n".join([line.strip() for line in text.splitlines()])
    return _BLANK_LINES.sub("\n\n", text).strip()


def _cut_out(text: str, positions: list[int]) -> str:
    """`text` without the characters at `positions` (ascending)."""
    if not positions:
        return text
    pieces, kept_from = [], 0
    for at in positions:
        pieces.append(text[kept_from:at])
        kept_from = at + 1
    pieces.append(text[kept_from:])
    return "".join(pieces)


def wikitext_to_text(wikitext: str) -> str:
    """The prose of an article's wikitext: headings and paragraphs, no markup."""
    import mwparserfromhell

    # Bold and italic quotes are kept as text (and dropped by _tidy): an unbalanced pair (a
    # caption's bold closed as italics) would make the parser give up its construct as text.
    code = mwparserfromhell.parse(prestrip(wikitext), skip_style_tags=True)
    _prune(code)
    _drop_empty_sections(code)
    return _tidy(code.strip_code(normalize=True, collapse=True))
