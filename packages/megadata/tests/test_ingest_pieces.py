"""Large files ingested in pieces (megadata.file_pieces): the same documents, ids and problems
as the file read whole, wherever the pieces' ends fall."""

import bz2
import itertools
import json
from pathlib import Path

import pytest
from corpus_inputs import wiki_dump

from megadata.documents import read_docs, read_table
from megadata.file_pieces import how_to_split
from megadata.recipe import RecipeError, load_recipe, run_stage
from megadata.runner import Runner
from megadata.stages import ingest


def ingest_source(tmp_path: Path, name: str, source: str, split_bytes: int) -> dict:
    """Ingest one source (its TOML lines, without `split_mb`) with pieces of `split_bytes`
    (0: the file whole): documents, listed problems, stage totals and partition names."""
    recipe_path = tmp_path / f"{name}.toml"
    split_mb = split_bytes / 2**20
    recipe_path.write_text(
        f'name = "pieces"\noutput = "out-{name}"\n[[sources]]\n{source}\nsplit_mb = {split_mb!r}\n'
    )
    recipe = load_recipe(recipe_path)
    with Runner(workers=1, progress=False) as runner:
        stats = run_stage(recipe, "ingest", runner)
    stage = recipe.work / "ingest"
    parts = sorted(stage.glob("*.arrow"))
    listed = [
        json.loads(line)
        for report in sorted((stage / ingest.PROBLEMS_DIR).glob("*.jsonl"))
        for line in report.read_text().splitlines()
    ]
    return {
        "docs": [d for p in parts for d in read_docs(p)],
        "listed": listed,
        "stats": (stats.docs_in, stats.docs_out, stats.bytes_in, stats.extra),
        "parts": [p.name for p in parts],
        "filled": sum(1 for p in parts if read_table(p).num_rows),  # partitions with documents
    }


def jsonl_line(text: str) -> bytes:
    return (json.dumps({"text": text, "title": text[:12]}) + "\n").encode()


def line_files(raw: Path) -> dict[str, bytes]:
    """A jsonl and a text file with every kind of line that a piece's end may fall in."""
    jsonl = [b"\xef\xbb\xbf" + jsonl_line("The first document, after a byte-order mark.")]
    text = [b"\xef\xbb\xbfThe first line, after a byte-order mark.\n"]
    for i in range(40):
        words = " ".join(f"w{i}-{j}" for j in range(i * 7 % 50))
        jsonl.append(jsonl_line(f"Document {i}: {words}"))
        text.append(f"Line {i}: {words}\n".encode())
        if i % 9 == 0:
            jsonl.append(b"not json at all\n")
            text.append(b"two documents\x0cin one line, cut at its form feed\n")
        if i % 11 == 0:
            jsonl.append(b'{"text": "caf\xe9 is not UTF-8"}\n')
            text.append(b"caf\xe9 is not UTF-8\n")
        if i % 13 == 0:
            jsonl.append(b"\n")
            text.append(b"\r\n")
        if i == 20:  # longer than the pieces: it starts in one and ends several later
            jsonl.append(jsonl_line("long " * 600))
            text.append(b"long " * 600 + b"\n")
        if i == 30:  # over max_doc_bytes: read past in chunks
            jsonl.append(jsonl_line("too long " * 300))
            text.append(b"too long " * 300 + b"\n")
    jsonl.append(jsonl_line("The last document, without a newline.")[:-1])
    text.append(b"The last line, without a newline.")
    files = {"jsonl": b"".join(jsonl), "text": b"".join(text)}
    for kind, data in files.items():
        (raw / f"big.{kind}").write_bytes(data)
    return files


@pytest.mark.parametrize("kind", ["jsonl", "text"])
def test_a_file_of_lines_in_pieces_is_the_file_whole(tmp_path, kind):
    raw = tmp_path / "raw"
    raw.mkdir()
    data = line_files(raw)[kind]
    source = f'name = "src"\nkind = "{kind}"\npaths = ["raw/big.{kind}"]\nmax_doc_bytes = 2000'
    if kind == "text":
        source += '\nsplit = "line"'
    whole = ingest_source(tmp_path, "whole", source, 0)
    assert whole["parts"] == ["src-00000-0000.arrow"]
    ids = [d["doc_id"].rsplit("#", 1)[1] for d in whole["docs"]]
    assert ids[:2] == ["0", "1"] and len(set(ids)) == len(ids)
    if kind == "text":  # the line with a form feed: two documents, keyed line and line.1
        assert "2.1" in ids
    kinds = {r["problem"] for r in whole["listed"]}
    assert kinds == ({"bad_json", "not_utf8", "too_large"} if kind == "jsonl" else
                     {"not_utf8", "too_large"})  # fmt: skip
    first_line = data.index(b"\n") + 1  # pieces that start where lines start, and others
    for size in (first_line, 97, 256, 1000, 4096):
        cut = ingest_source(tmp_path, f"cut-{size}", source, size)
        assert len(cut["parts"]) == -(-len(data) // size), size  # a task (and partition) a piece
        assert all("-p" in name for name in cut["parts"])
        assert cut["filled"] >= 2, size
        assert cut["docs"] == whole["docs"], size
        assert cut["listed"] == whole["listed"], size  # the same lines named
        assert cut["stats"] == whole["stats"], size


def multistream(xml: bytes, cuts) -> bytes:
    """`xml` compressed as one bz2 stream per span between the cuts (as Wikimedia's
    -multistream dumps are, where the cuts fall between pages)."""
    bounds = [0, *cuts, len(xml)]
    return b"".join(bz2.compress(xml[a:b], 1) for a, b in itertools.pairwise(bounds))


@pytest.mark.parametrize("layout", ["xml", "bz2-page-streams", "bz2-streams-anywhere"])
def test_a_dump_in_pieces_is_the_dump_whole(tmp_path, documents, layout):
    raw = tmp_path / "raw"
    raw.mkdir()
    xml = wiki_dump(documents[:24]).replace("</revision></page>", "</revision></page>\n", 3)
    broken = xml.index("<page>", xml.index("<page>") + 1)  # the second page: bad XML
    xml = (xml[:broken] + xml[broken:].replace("</title>", "</titl>", 1)).encode()
    starts = [i for i in range(len(xml)) if xml.startswith(b"<page>", i)]
    if layout == "xml":
        name, data = "dump.xml", xml
    elif layout == "bz2-page-streams":
        name, data = "dump.xml.bz2", multistream(xml, starts[::3])  # header, then 3 pages each
    else:
        name, data = "dump.xml.bz2", multistream(xml, range(1500, len(xml), 1500))
    (raw / name).write_bytes(data)
    source = f'name = "wiki"\nkind = "wikipedia"\npaths = ["raw/{name}"]'
    whole = ingest_source(tmp_path, "whole", source, 0)
    titles = [d["title"] for d in whole["docs"]]
    assert len(titles) == 23 and documents[1]["title"] not in titles  # the broken page
    assert [r["problem"] for r in whole["listed"]] == ["bad_xml"]
    for size in (len(data) // 17, len(data) // 5, len(data) // 2):
        cut = ingest_source(tmp_path, f"cut-{size}", source, size)
        assert len(cut["parts"]) == -(-len(data) // size), size
        assert cut["filled"] >= 2, size
        assert cut["docs"] == whole["docs"], size
        assert [r["problem"] for r in cut["listed"]] == ["bad_xml"], size
        assert cut["stats"] == whole["stats"], size
    if layout == "bz2-streams-anywhere":  # cut short: the pages before the cut, in both
        (raw / name).write_bytes(data[: len(data) * 2 // 3])
        whole = ingest_source(tmp_path, "short-whole", source, 0)
        cut = ingest_source(tmp_path, "short-cut", source, len(data) // 7)
        assert 0 < len(whole["docs"]) < 23 and cut["docs"] == whole["docs"]
        assert {r["problem"] for r in cut["listed"]} == {"bad_xml", "cut_short"}
        assert cut["stats"][3] == whole["stats"][3]


def test_what_cannot_start_in_the_middle_is_read_whole(tmp_path, documents):
    one_stream = tmp_path / "dump.xml.bz2"
    one_stream.write_bytes(bz2.compress(wiki_dump(documents[:8]).encode()))
    gz_lines = tmp_path / "docs.jsonl.gz"
    gz_lines.write_bytes(b"\0" * 4096)
    tiny = {"split_mb": 1 / 2**20}
    assert how_to_split("wikipedia", tiny, one_stream) == (None, 1)  # a plain dump: one stream
    assert how_to_split("jsonl", tiny, gz_lines) == (None, 1)
    assert how_to_split("text", tiny, gz_lines) == (None, 1)
    assert how_to_split("jsonl", {"split_mb": 0}, tmp_path / "dump.xml.bz2") == (None, 1)
    source = f'name = "wiki"\nkind = "wikipedia"\npaths = ["{one_stream}"]'
    assert len(ingest_source(tmp_path, "one", source, 1)["docs"]) == 8


@pytest.mark.parametrize("bad", ["-1", '"256"', "true"])
def test_a_bad_split_mb_is_named_before_any_work(tmp_path, bad):
    (tmp_path / "a.jsonl").write_bytes(jsonl_line("A document."))
    recipe_path = tmp_path / "recipe.toml"
    recipe_path.write_text(
        'name = "r"\noutput = "out"\n[[sources]]\nname = "news"\nkind = "jsonl"\n'
        f'paths = ["a.jsonl"]\nsplit_mb = {bad}\n'
    )
    recipe = load_recipe(recipe_path)
    expected = r"source 'news': split_mb must be a number >= 0"
    with pytest.raises(RecipeError, match=expected), Runner(workers=1, progress=False) as runner:
        run_stage(recipe, "ingest", runner)
    assert not (recipe.work / "ingest").exists()
