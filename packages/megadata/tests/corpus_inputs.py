"""Test inputs made from real English that ships with Python: the standard library's docstrings.

No network, no generated filler: each document is the documentation of one
public function or class, written by Python's authors.
"""

import importlib
import inspect
import json
import textwrap
import warnings
from pathlib import Path

MODULES = ("argparse", "subprocess", "difflib", "doctest", "pickle", "typing", "statistics", "csv")


def english_documents(min_chars: int = 600) -> list[dict]:
    docs, seen = [], set()
    for name in MODULES:
        module = importlib.import_module(name)
        for attr in sorted(dir(module)):
            if attr.startswith("_"):
                continue
            with warnings.catch_warnings():  # typing.io and typing.re warn when touched
                warnings.simplefilter("ignore", DeprecationWarning)
                obj = getattr(module, attr)
                doc = "" if inspect.ismodule(obj) else inspect.getdoc(obj) or ""
            if len(doc) >= min_chars and doc not in seen:
                seen.add(doc)
                docs.append({"title": f"{name}.{attr}", "text": doc})
    return docs


def write_inputs(root: Path, docs: list[dict]) -> dict[str, Path]:
    """The documents spread over the four input formats, as a recipe would find them."""
    root.mkdir(parents=True, exist_ok=True)
    quarter = len(docs) // 4
    jsonl, text, html, wiki = (docs[i * quarter : (i + 1) * quarter] for i in range(4))
    paths = {"jsonl": root / "docs.jsonl", "text": root / "docs.txt"}
    paths["jsonl"].write_text(
        "".join(
            json.dumps({"text": d["text"], "title": d["title"], "url": ""}) + "\n" for d in jsonl
        )
    )
    paths["text"].write_text("\n\n".join(d["text"].replace("\n\n", "\n") for d in text) + "\n")
    html_dir = root / "html"
    html_dir.mkdir(exist_ok=True)
    for i, d in enumerate(html):
        paragraphs = "".join(f"<p>{p}</p>" for p in d["text"].split("\n\n"))
        (html_dir / f"page{i:03d}.html").write_text(
            f"<html><head><title>{d['title']}</title></head><body><nav>Home | About</nav>"
            f"<article><h1>{d['title']}</h1>{paragraphs}</article><footer>(c)</footer></body></html>"
        )
    paths["html"] = html_dir
    paths["wiki"] = root / "wiki.xml"
    paths["wiki"].write_text(wiki_dump(wiki))
    return paths


def wiki_dump(docs: list[dict]) -> str:
    pages = []
    for i, d in enumerate(docs):
        body = d["text"].replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
        pages.append(
            f"<page><title>{d['title']}</title><ns>0</ns><id>{100 + i}</id><revision><id>1</id>"
            f"<text>'''{d['title']}''' is documented here.\n\n{body}\n\n[[Category:Python]]</text>"
            "</revision></page>"
        )
    pages.append(
        '<page><title>Old name</title><ns>0</ns><id>7</id><redirect title="New"/>'
        "<revision><text>#REDIRECT [[New]]</text></revision></page>"
    )
    pages.append(
        "<page><title>Talk:Thing</title><ns>1</ns><id>8</id>"
        "<revision><text>A talk page that is not an article.</text></revision></page>"
    )
    ns = "http://www.mediawiki.org/xml/export-0.10/"
    return f'<mediawiki xmlns="{ns}"><siteinfo/>{"".join(pages)}</mediawiki>\n'


def write_recipe(path: Path, inputs: dict[str, Path], output: Path, **sections) -> Path:
    base = {
        "clean": {"min_english_prob": 0.9, "seed": 0},
        "tokenizer": {"kind": "gpt2-bpe", "vocab_size": 2000},
        "filter": {"min_tokens": 64},
        "dedup": {"threshold": 0.7, "num_perm": 128, "shingle_words": 2},
        "shard": {"valid_every": 30, "shard_tokens": 20000},
    }
    for key, value in sections.items():
        base[key] = {**base.get(key, {}), **value}

    def toml_table(name, d):
        return f"[{name}]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in d.items())

    text = textwrap.dedent(
        f"""\
        name = "test"
        output = {json.dumps(str(output))}
        partition_docs = 20

        [[sources]]
        name = "pydocs"
        kind = "jsonl"
        paths = [{json.dumps(str(inputs["jsonl"]))}]
        split_mb = 0.008  # pieces of 8 kB, a task each: how a large file is read

        [[sources]]
        name = "notes"
        kind = "text"
        split = "paragraph"
        paths = [{json.dumps(str(inputs["text"]))}]

        [[sources]]
        name = "pages"
        kind = "html"
        paths = [{json.dumps(str(inputs["html"] / "*.html"))}]

        [[sources]]
        name = "wiki"
        kind = "wikipedia"
        paths = [{json.dumps(str(inputs["wiki"]))}]
        split_mb = 0.008
        """
    )
    text += "\n".join(toml_table(k, v) for k, v in base.items())
    path.write_text(text)
    return path
