"""`ftfy.fix_text`, handing ftfy only the lines it could change.

ftfy fixes a text one line (with its "\\n") at a time, each on its own, except that after
the first line holding a "<" it stops unescaping HTML entities (the text may be HTML).
One pass of its fixers that changes nothing leaves a line as it is, and that pass needs:
- "&" to unescape an entity, "\\x1b" for a terminal escape, "\\r" for a line break;
- for mojibake, a match of ftfy's badness regex: each branch of it needs one character
  of a fixed set, which is read here from the compiled pattern (for each branch, the
  characters of one of its required classes, preferring sets without lower-case letters,
  as "é" is common and rarely mojibake on its own);
- for the character fixers (C1 controls, ligatures, widths, curly quotes, line breaks,
  surrogates, control characters), a character one of them changes: they work character
  by character, so those are found by trying each;
- for NFC, a line that is not NFC already (`unicodedata.is_normalized`, in C).
So a line of printable ASCII and "safe" characters (below U+3000, in none of those sets)
that is NFC is passed over.  A line that cannot match the badness regex (it lacks a
character of one of the sets each branch requires) and holds no HTML entity only meets
ftfy's character fixers and NFC, which are run here in ftfy's loop; any other line goes
to ftfy as before (on the plain jsonl corpus, one line in five of those with curly
quotes and the like).  On Wikipedia text
this sends ftfy 6x fewer lines than passing over printable ASCII alone.  Finding the
safe set takes about 0.1 s once per process.  An ftfy whose settings differ from those
this reasoning was checked against (version 6.x's) gets only printable ASCII passed over.
"""

import functools
import re
import unicodedata

import ftfy

# What ftfy may change on a line of printable ASCII, tab and newline: `&` (entities).
_PRINTABLE = "\t\n\x20-\x25\x27-\x7e"
_FTFY_DEFAULTS = {
    "unescape_html": "auto",
    "remove_terminal_escapes": True,
    "fix_encoding": True,
    "restore_byte_a0": True,
    "replace_lossy_sequences": True,
    "decode_inconsistent_utf8": True,
    "fix_c1_controls": True,
    "fix_latin_ligatures": True,
    "fix_character_width": True,
    "uncurl_quotes": True,
    "fix_line_breaks": True,
    "fix_surrogates": True,
    "remove_control_chars": True,
    "normalization": "NFC",
    "max_decode_length": 1_000_000,
    "explain": True,
}
_SAFE_BELOW = 0x3000
# ftfy 6's loop (`fix_and_explain`): its character fixers in its order, then NFC.
_FIX_ORDER = (
    "fix_c1_controls",
    "fix_latin_ligatures",
    "fix_character_width",
    "uncurl_quotes",
    "fix_line_breaks",
    "fix_surrogates",
    "remove_terminal_escapes",
    "remove_control_chars",
)
_HTML_ENTITY = re.compile(r"&#?[0-9A-Za-z]{1,24};")  # ftfy's HTML_ENTITY_RE
# The fixers that work character by character ("\x1b" starts a terminal escape sequence,
# so a line holding one always goes to ftfy).
_CHAR_FIXERS = tuple(name for name in _FIX_ORDER if name != "remove_terminal_escapes")


@functools.cache
def _badness_branches() -> tuple[tuple[frozenset[str], ...], ...] | None:
    """For each branch of ftfy's badness regex, the sets of characters it requires (one
    of each set, in every match; sets holding ASCII left out); None when the pattern is
    not made as expected (then nothing non-ASCII is passed over)."""
    from ftfy.badness import BADNESS_RE

    parser = getattr(re, "_parser", None)
    if parser is None:  # Python 3.10
        import sre_parse as parser
    if BADNESS_RE.flags & re.IGNORECASE:
        return None
    (op, branch), *rest = parser.parse(BADNESS_RE.pattern, BADNESS_RE.flags).data
    if rest or op.name != "BRANCH":
        return None

    def chars(op, av) -> set[str] | None:  # a single, required character's choices
        if op.name == "LITERAL":
            return {chr(av)}
        if op.name != "IN":
            return None
        out = set()
        for item_op, item in av:
            if item_op.name == "LITERAL":
                out.add(chr(item))
            elif item_op.name == "RANGE":
                out.update(map(chr, range(item[0], item[1] + 1)))
            else:  # NEGATE, CATEGORY (\w, \s): not a small set
                return None
        return out

    branches = []
    for alternative in branch[1]:
        choices = [s for s in (chars(o, a) for o, a in alternative.data) if s]
        choices = [frozenset(s) for s in choices if not any(c < "\x80" for c in s)]
        if not choices:
            return None
        branches.append(tuple(choices))
    return tuple(branches)


def _badness_needs() -> set[str] | None:
    """Characters one of which every match of ftfy's badness regex contains."""
    branches = _badness_branches()
    if branches is None:
        return None
    lower = {c for c in map(chr, range(0x80, _SAFE_BELOW)) if unicodedata.category(c) == "Ll"}
    return set().union(*(min(b, key=lambda s: (len(s & lower), len(s))) for b in branches))


@functools.cache
def _as_checked() -> bool:
    """Whether ftfy is as this module's reasoning was checked against (version 6.x)."""
    from ftfy.chardata import HTML_ENTITY_RE

    return (
        ftfy.__version__.startswith("6.")
        and ftfy.TextFixerConfig()._asdict() == _FTFY_DEFAULTS
        and HTML_ENTITY_RE.pattern == _HTML_ENTITY.pattern
        and _badness_branches() is not None
    )


@functools.cache
def _may_change() -> re.Pattern:
    """A character on whose line ftfy may change something."""
    needs = _badness_needs() if _as_checked() else None
    if needs is None:
        return re.compile(f"[^{_PRINTABLE}]")
    fixers = [ftfy.FIXERS[name] for name in _CHAR_FIXERS]
    safe = [
        c
        for c in range(0xA0, _SAFE_BELOW)
        if chr(c) not in needs and all(f(chr(c)) == chr(c) for f in fixers)
    ]
    ranges, start = [], None
    for i, c in enumerate(safe):
        start = c if start is None else start
        if i + 1 == len(safe) or safe[i + 1] != c + 1:
            ranges.append(f"{re.escape(chr(start))}-{re.escape(chr(c))}")
            start = None
    return re.compile(f"[^{_PRINTABLE}{''.join(ranges)}]")


def _unchanged(text: str) -> bool:
    return not _may_change().search(text) and (
        text.isascii() or unicodedata.is_normalized("NFC", text)
    )


def _may_be_bad(text: str) -> bool:
    """False when no branch of ftfy's badness regex can match: each needs a character of
    every one of its sets, and the text lacks one in each branch (`is_bad` runs the whole
    regex at every position, 0.2 ms a line)."""
    branches, every = _badness_branches(), _badness_chars()
    present = every.intersection(text)
    return bool(present) and any(all(not s.isdisjoint(present) for s in b) for b in branches)


@functools.cache
def _badness_chars() -> frozenset[str]:
    return frozenset().union(*(s for b in _badness_branches() for s in b))


def _fix_line(segment: str, html: bool) -> str:
    """`ftfy.fix_text(segment)` for one line.  While the text holds no HTML entity and
    cannot be mojibake (`_may_be_bad`), ftfy's unescaping and encoding steps leave it as
    it is, so its loop is its character fixers and NFC, run here; ftfy runs on the line as
    soon as that is not so."""
    kwargs = {"unescape_html": False} if html else {}
    if not _as_checked() or len(segment) > _FTFY_DEFAULTS["max_decode_length"]:
        return ftfy.fix_text(segment, **kwargs)
    text = segment
    while True:
        if _HTML_ENTITY.search(text) or _may_be_bad(text):
            return ftfy.fix_text(segment, **kwargs)
        before = text
        for name in _FIX_ORDER:
            text = ftfy.FIXERS[name](text)
        text = unicodedata.normalize("NFC", text)
        if text == before:
            return text


def fix_text(text: str) -> str:
    """`ftfy.fix_text(text)`, with the lines it would leave as they are passed over."""
    if _unchanged(text):
        return text
    lines = text.split("\n")
    last = len(lines) - 1
    out, html = [], False
    for i, line in enumerate(lines):
        segment = line + "\n" if i < last else line  # ftfy may change the "\n" too
        if not _unchanged(line):
            segment = _fix_line(segment, html)
        html = html or "<" in line
        out.append(segment)
    return "".join(out)
