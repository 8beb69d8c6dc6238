"""Ingest on bad input: nothing lost, nothing mangled, every problem named, counted, listed.

Each test puts one kind of bad input between good documents and checks that the good
ones all arrive, that the bad one is skipped (or repaired) and that it is named with its
file and line, counted in the stage's statistics and listed in `_problems/`.
"""

import json
import logging
import time
import tracemalloc
from pathlib import Path

import pytest

from megadata.documents import read_docs
from megadata.recipe import load_recipe, run_stage
from megadata.runner import Runner
from megadata.stages import ingest

GOOD = [
    "The first good document, which must arrive untouched.",
    "The second good document, which must arrive as well.",
]


def jsonl_line(text: str, **fields) -> bytes:
    return (json.dumps({"text": text, **fields}) + "\n").encode()


def good_around(bad: bytes) -> bytes:
    """A jsonl file: good line 1, the bad line 2, good line 3."""
    return jsonl_line(GOOD[0]) + bad + jsonl_line(GOOD[1])


def ingest_one(tmp_path: Path, kind: str, data: bytes, name: str, **options):
    """(documents, counts, listed problems) of one file through the stage's task."""
    path = tmp_path / name
    path.write_bytes(data)
    out = tmp_path / "out"
    counts = ingest.ingest_file("src", kind, options, str(path), 0, str(out), 1000)
    docs = [d for p in sorted(out.glob("*.arrow")) for d in read_docs(p)]
    report = out / ingest.PROBLEMS_DIR / "src-00000.jsonl"
    lines = report.read_text().splitlines() if report.exists() else []
    listed = [json.loads(line) for line in lines]
    return docs, counts, listed


def where(listed: list[dict]) -> list[tuple]:
    return [(Path(r["file"]).name, r["line"], r["problem"]) for r in listed]


# ------------------------------------------------------------------- jsonl


def test_lone_surrogate_is_removed_counted_and_the_rest_arrives(tmp_path, caplog):
    # As a JSON escape: json.loads makes a str that no UTF-8 writer accepts.
    bad = b'{"text": "before \\ud800 after", "title": "t\\udfff"}\n'
    pair = b'{"text": "an emoji \\ud83d\\ude00 is a valid pair"}\n'
    with caplog.at_level(logging.WARNING):
        docs, counts, listed = ingest_one(tmp_path, "jsonl", good_around(bad) + pair, "s.jsonl")
    assert [d["text"] for d in docs] == [GOOD[0], "before  after", GOOD[1], pair_text()]
    assert docs[1]["title"] == "t"
    assert counts["extra"] == {"lone_surrogates": 1}
    assert where(listed) == [("s.jsonl", 2, "lone_surrogates")]
    assert listed[0]["action"] == "removed" and "2 lone surrogate" in listed[0]["detail"]
    assert f"{tmp_path / 's.jsonl'}:2: 2 lone surrogate escapes; removed" in caplog.text


def pair_text() -> str:
    return "an emoji \U0001f600 is a valid pair"


def test_line_not_utf8_is_named_skipped_and_never_wins_over_the_clean_copy(tmp_path, caplog):
    clean = "The café on the corner opens at seven and closes when the last guest leaves."
    mangled = jsonl_line(clean).replace(b"caf\\u00e9", b"caf\xe9")
    assert b"\xe9" in mangled
    data = jsonl_line(GOOD[0]) + mangled + jsonl_line(clean) + jsonl_line(GOOD[1])
    with caplog.at_level(logging.WARNING):
        docs, counts, listed = ingest_one(tmp_path, "jsonl", data, "news.jsonl")
    assert [d["text"] for d in docs] == [GOOD[0], clean, GOOD[1]]
    assert not any("\ufffd" in d["text"] for d in docs)
    assert counts["extra"] == {"not_utf8": 1}
    assert where(listed) == [("news.jsonl", 2, "not_utf8")]
    assert listed[0]["action"] == "line skipped"
    assert f"{tmp_path / 'news.jsonl'}:2: not UTF-8" in caplog.text


def test_byte_order_mark_is_dropped(tmp_path):
    docs, counts, listed = ingest_one(
        tmp_path, "jsonl", b"\xef\xbb\xbf" + good_around(b""), "bom.jsonl"
    )
    assert [d["text"] for d in docs] == GOOD  # the first line is not "not JSON"
    assert counts["extra"] == {} and listed == []


def test_nul_characters_are_removed_and_counted(tmp_path):
    escaped = jsonl_line("tab\tand NUL\x00 inside")  # json.dumps writes \u0000
    raw = b'{"text": "a raw NUL\x00 byte"}\n'
    zeroed = b"\x00" * 64 + jsonl_line("after a zeroed block")  # a crash left zeros behind
    docs, counts, listed = ingest_one(
        tmp_path, "jsonl", good_around(escaped) + raw + zeroed, "nul.jsonl"
    )
    texts = [d["text"] for d in docs]
    assert texts == [
        GOOD[0],
        "tab\tand NUL inside",
        GOOD[1],
        "a raw NUL byte",
        "after a zeroed block",
    ]
    assert counts["extra"] == {"nul_chars": 3}
    assert where(listed) == [
        ("nul.jsonl", 2, "nul_chars"),
        ("nul.jsonl", 4, "nul_chars"),
        ("nul.jsonl", 5, "nul_chars"),
    ]


def test_deep_nesting_and_huge_integers_are_skipped_not_fatal(tmp_path, caplog):
    deep = b'{"text": "x", "meta": ' + b"[" * 200_000 + b"]" * 200_000 + b"}\n"
    deep_list = b"[" * 200_000 + b"]" * 200_000 + b"\n"
    huge_int = b'{"text": "x", "n": ' + b"9" * 5000 + b"}\n"
    data = good_around(deep) + deep_list + huge_int + jsonl_line("the last one")
    with caplog.at_level(logging.WARNING):
        docs, counts, listed = ingest_one(tmp_path, "jsonl", data, "deep.jsonl")
    assert [d["text"] for d in docs] == [*GOOD, "the last one"]
    assert counts["extra"] == {"too_deep": 2, "bad_json": 1}
    assert where(listed) == [
        ("deep.jsonl", 2, "too_deep"),
        ("deep.jsonl", 4, "too_deep"),
        ("deep.jsonl", 5, "bad_json"),
    ]
    assert f"{tmp_path / 'deep.jsonl'}:2: JSON nested too deeply; line skipped" in caplog.text


def test_a_50_mb_line_is_skipped_in_bounded_memory_or_kept_whole(tmp_path):
    big_text = ("All work and no play makes Jack a dull boy. " * 1_200_000)[:50_000_000]
    path = tmp_path / "big.jsonl"
    path.write_bytes(good_around(jsonl_line(big_text)))

    # Over max_doc_bytes (16 MiB by default): named and skipped.
    problems, listed = {}, []
    started = time.monotonic()
    docs = list(ingest.read_jsonl(path, problems, listed=listed))
    assert time.monotonic() - started < 10
    assert [d["text"] for d in docs] == GOOD
    assert problems == {"too_large": 1}
    assert where(listed) == [("big.jsonl", 2, "too_large")]
    assert "50000013 bytes is over max_doc_bytes = 16777216" in listed[0]["detail"]

    # Never held whole: the memory it takes is bounded by the limit, not by the line.
    tracemalloc.start()
    try:
        docs = list(ingest.read_jsonl(path, problems := {}, max_doc_bytes=2_000_000))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert [d["text"] for d in docs] == GOOD and problems == {"too_large": 1}
    assert peak < 8e6, f"{peak / 1e6:.0f} MB held to skip a 50 MB line"

    # A source that allows it: the document arrives whole, in time linear in its size.
    started = time.monotonic()
    docs = list(ingest.read_jsonl(path, problems := {}, max_doc_bytes=64_000_000))
    assert time.monotonic() - started < 20
    assert [len(d["text"]) for d in docs] == [len(GOOD[0]), 50_000_000, len(GOOD[1])]
    assert docs[1]["text"] == big_text and problems == {}


def test_max_doc_bytes_is_a_source_option_and_checked(tmp_path):
    data = good_around(jsonl_line("x" * 500))
    docs, counts, _ = ingest_one(tmp_path, "jsonl", data, "s.jsonl", max_doc_bytes=200)
    assert [d["text"] for d in docs] == GOOD and counts["extra"] == {"too_large": 1}
    with pytest.raises(ValueError, match="max_doc_bytes must be a positive integer"):
        ingest_one(tmp_path, "jsonl", data, "t.jsonl", max_doc_bytes="1MB")


# ------------------------------------------------------------------- text


def old_read_text(text: str, split: str) -> list[str]:
    """The reader as it was, for valid UTF-8: the streaming reader must split the same way."""
    if split == "file":
        pieces = [text]
    elif split == "line":
        pieces = text.splitlines()
    else:
        pieces = text.replace("\r\n", "\n").split("\n\n")
    return [p.strip() for p in pieces if p.strip()]


@pytest.mark.parametrize("split", ["file", "line", "paragraph"])
def test_text_splits_as_before(tmp_path, split):
    text = (
        "First para\r\nstill first.\r\n\r\nSecond\n \nstill second\n\n\n\nThird\rwith CR\n"
        "form\x0cfeed and\u2028separator\n\n  indented  \n\n\n"
    )
    path = tmp_path / "t.txt"
    path.write_text(text, newline="")
    assert [d["text"] for d in ingest.read_text(path, split, {})] == old_read_text(text, split)


def test_text_bad_lines_are_named_and_skipped(tmp_path):
    data = (
        b"\xef\xbb\xbfA first paragraph\nof two lines.\n\n"
        b"A paragraph with a bad \xff byte\non its first line.\n\n"
        b"A clean paragraph with NUL\x00 in it.\n"
    )
    path = tmp_path / "notes.txt"
    path.write_bytes(data)

    problems, listed = {}, []
    texts = [d["text"] for d in ingest.read_text(path, "paragraph", problems, listed=listed)]
    assert texts == [
        "A first paragraph\nof two lines.",
        "A clean paragraph with NUL in it.",
    ]
    assert problems == {"not_utf8": 1, "nul_chars": 1}
    assert where(listed) == [("notes.txt", 4, "not_utf8"), ("notes.txt", 7, "nul_chars")]

    problems, listed = {}, []
    texts = [d["text"] for d in ingest.read_text(path, "line", problems, listed=listed)]
    assert texts == [
        "A first paragraph",
        "of two lines.",
        "on its first line.",
        "A clean paragraph with NUL in it.",
    ]
    assert where(listed) == [("notes.txt", 4, "not_utf8"), ("notes.txt", 7, "nul_chars")]

    problems, listed = {}, []
    assert list(ingest.read_text(path, "file", problems, listed=listed)) == []
    assert where(listed) == [("notes.txt", 4, "not_utf8")]  # the line of the first bad byte
    assert listed[0]["action"] == "file skipped"

    bom_only = tmp_path / "bom.txt"
    bom_only.write_bytes(b"\xef\xbb\xbfOne story.\n")
    assert [d["text"] for d in ingest.read_text(bom_only, "file", {})] == ["One story."]


def test_html_in_another_charset_is_decoded_by_its_meta(tmp_path):
    body = (
        "The café by the station serves crème brûlée to every traveller who is waiting for "
        "the night train, and the owner, who has run it for thirty years, knows them all. "
    ) * 6
    page = (
        '<html><head><meta charset="iso-8859-1"><title>Station</title></head>'
        f"<body><article><p>{body}</p><p>{body}</p></article></body></html>"
    ).encode("latin-1")
    docs, counts, _ = ingest_one(tmp_path, "html", page, "station.html")
    assert "The café by the station serves crème brûlée" in docs[0]["text"]
    assert "\ufffd" not in docs[0]["text"] and counts["extra"] == {}


# ------------------------------------------------------------------- wikipedia

ARTICLE = """{{Short description|French painter (1880-1950)}}
{{Use dmy dates|date=March 2020}}
{{Infobox artist
| name        = Jean Dupont
| image       = Jean Dupont 1920.jpg
| birth_date  = {{birth date|1880|1|1|df=y}}
| birth_place = [[Lyon]], France
}}
[[File:Jean Dupont 1920.jpg|thumb|left|alt=A man in a hat beside an easel|'''Dupont''' in \
1920, painting [[Paris]]'']]
'''Jean Dupont''' ({{IPA-fr|ʒɑ̃ dypɔ̃|lang}}; born 1 January 1880{{sfn|Smith|2001|p=4}}) was \
a French [[painter]].<ref>{{cite web |url=http://example.com/dupont |title=Dupont}}</ref> \
He lived in [[Lyon]] ({{lang-fr|Lyon}}).<ref name="b" />

== Life ==
Dupont studied in Paris ({{convert|3|km|mi}}) under [[Claude Monet|Monet]].\
<ref name="b">Brown, ''Painters'', p. 3.</ref>
[[Image:Dupont signature.svg|200px|right|upright=0.5|Signature]]

=== Works ===
{| class="wikitable sortable"
|+ Selected works
|-
! Year !! Work
|-
| 1901 || ''Sunset over the harbour''
|-
| 1905 || [[Harbour (painting)|''Harbour'']]
|}
He died in 1950 (, aged 70).

== Gallery ==
<gallery>
File:A.jpg|First painting
File:B.jpg|Second painting
</gallery>

== References ==
{{Reflist}}

== External links ==
* {{Commons category|Jean Dupont}}

{{Authority control}}
__NOTOC__
[[Category:French painters]]
[[Category:1880 births|Dupont, Jean]]
[[fr:Jean Dupont]]
[[de:Jean Dupont]]
"""


def dump(*pages: str) -> str:
    return (
        '<mediawiki xmlns="http://www.mediawiki.org/xml/export-0.10/" xml:lang="en">\n'
        "  <siteinfo>\n    <sitename>Wikipedia</sitename>\n  </siteinfo>\n"
        + "".join(pages)
        + "</mediawiki>\n"
    )


def page(title: str, page_id: int, wikitext: str) -> str:
    escaped = wikitext.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    return (
        f"  <page>\n    <title>{title}</title>\n    <ns>0</ns>\n    <id>{page_id}</id>\n"
        f'    <revision>\n      <id>1</id>\n      <text xml:space="preserve">{escaped}</text>\n'
        "    </revision>\n  </page>\n"
    )


def test_wikipedia_article_keeps_prose_only(tmp_path):
    path = tmp_path / "wiki.xml"
    path.write_text(dump(page("Jean Dupont", 42, ARTICLE)))
    problems: dict = {}
    (doc,) = ingest.read_wikipedia(path, problems)
    text = doc["text"]
    assert text == (
        "Jean Dupont (born 1 January 1880) was a French painter. He lived in Lyon.\n"
        "\n"
        "Life\n"
        "Dupont studied in Paris under Monet.\n"
        "\n"
        "Works\n"
        "\n"
        "He died in 1950 (aged 70)."
    )
    for leftover in [
        "thumb", "alt=", "200px", "upright", "Signature", "hat", "|", "[[", "]]", "{{", "}}",
        "<ref", "Brown", "()", "(;", "(,", "Year", "Sunset", "wikitable", "''", "Category",
        "births", "fr:", "de:", "Gallery", "References", "External links", "NOTOC", "painting",
    ]:  # fmt: skip
        assert leftover not in text, leftover
    assert problems == {}
    assert doc["title"] == "Jean Dupont" and doc["url"].endswith("curid=42")


def test_wikipedia_bad_page_costs_only_itself(tmp_path, caplog):
    good = [page(f"Good {i}", 10 + i, f"'''Good {i}''' is a fine article.") for i in range(3)]
    broken = good[1].replace("fine article.", "fine article.</text><oops>")  # not well-formed
    big = page("Too big", 99, "Word " * 50_000)
    path = tmp_path / "wiki.xml"
    path.write_text(dump(good[0], broken, big, good[2]))
    problems, listed = {}, []
    with caplog.at_level(logging.WARNING):
        docs = list(ingest.read_wikipedia(path, problems, max_doc_bytes=100_000, listed=listed))
    assert [d["title"] for d in docs] == ["Good 0", "Good 2"]
    assert problems == {"bad_xml": 1, "too_large": 1}
    assert where(listed) == [("wiki.xml", 20, "bad_xml"), ("wiki.xml", 23, "too_large")]
    assert f"{path}:20: page not parsed as XML" in caplog.text  # the line of the error


def test_a_dump_cut_short_keeps_what_came_before(tmp_path):
    import bz2

    words = [" ".join(f"w{i * j}" for j in range(2000)) for i in range(50)]
    pages = [page(f"Article {i}", i, f"'''Article {i}''' {words[i]}") for i in range(50)]
    data = bz2.compress(dump(*pages).encode(), compresslevel=1)  # blocks of 100 kB: several
    docs, counts, listed = ingest_one(tmp_path, "wikipedia", data[: len(data) // 2], "cut.xml.bz2")
    assert counts["extra"] == {"cut_short": 1}
    assert where(listed) == [("cut.xml.bz2", None, "cut_short")]
    assert 0 < len(docs) < 50
    assert [d["title"] for d in docs] == [f"Article {i}" for i in range(len(docs))]


# ------------------------------------------------------------------- the stage


def test_ingest_stage_counts_and_lists_every_problem(tmp_path):
    raw = tmp_path / "raw"
    raw.mkdir()
    (raw / "a.jsonl").write_bytes(
        b"\xef\xbb\xbf"
        + jsonl_line(GOOD[0])
        + b'{"text": "caf\xe9"}\n'
        + b'{"text": "half \\udc00 a pair"}\n'
        + b"[" * 100_000
        + b"\n"
        + jsonl_line(GOOD[1])
    )
    (raw / "b.txt").write_bytes(b"\xef\xbb\xbfOne line.\nA bad \xc3( line.\nLast line.\n")
    recipe_path = tmp_path / "recipe.toml"
    recipe_path.write_text(
        'name = "bad-input"\noutput = "corpus"\n'
        '[[sources]]\nname = "news"\nkind = "jsonl"\npaths = ["raw/a.jsonl"]\n'
        '[[sources]]\nname = "notes"\nkind = "text"\nsplit = "line"\npaths = ["raw/b.txt"]\n'
    )
    recipe = load_recipe(recipe_path)
    with Runner(workers=1, progress=False) as runner:
        stats = run_stage(recipe, "ingest", runner)

    stage = recipe.work / "ingest"
    texts = [d["text"] for p in sorted(stage.glob("*.arrow")) for d in read_docs(p)]
    assert texts == [GOOD[0], "half  a pair", GOOD[1], "One line.", "Last line."]
    expected = {"not_utf8": 2, "lone_surrogates": 1, "too_deep": 1}
    assert stats.extra == expected
    assert json.loads((stage / "_DONE.json").read_text())["extra"] == expected
    listed = [
        json.loads(line)
        for report in sorted((stage / ingest.PROBLEMS_DIR).glob("*.jsonl"))
        for line in report.read_text().splitlines()
    ]
    assert where(listed) == [
        ("a.jsonl", 2, "not_utf8"),
        ("a.jsonl", 3, "lone_surrogates"),
        ("a.jsonl", 4, "too_deep"),
        ("b.txt", 2, "not_utf8"),
    ]


def test_a_file_full_of_bad_lines_does_not_flood_the_log(tmp_path, caplog):
    data = jsonl_line(GOOD[0]) + b"not json\n" * 30 + jsonl_line(GOOD[1])
    with caplog.at_level(logging.WARNING):
        docs, counts, listed = ingest_one(tmp_path, "jsonl", data, "junk.jsonl")
    assert [d["text"] for d in docs] == GOOD
    assert counts["extra"] == {"bad_json": 30} and len(listed) == 30
    assert [r["line"] for r in listed] == list(range(2, 32))
    named = [r.message for r in caplog.records if "not JSON" in r.message]
    assert len(named) == ingest.WARNINGS_PER_FILE
    assert "more problems not named here" in caplog.records[-1].message
