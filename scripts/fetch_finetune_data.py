"""Fetch real rows of the fine-tuning tasks, in their official formats, from the package index.

`make finetune-data` runs this.  It needs only the package registry (pip), not the open
internet: the source archive of `datasets==1.18.4` carries, as test fixtures, real samples
of the task files (`datasets/<name>/dummy/**/dummy_data.zip`).  pip downloads that archive
once into `--cache` (checked against its sha256); the task files are taken out of it with
their bytes unchanged and laid out as `megaeval finetune TASK --data OUT/TASK` reads them:

    OUT/mnli/    train.tsv dev_matched.tsv dev_mismatched.tsv        GLUE MNLI
    OUT/qqp/     train.tsv dev.tsv                                   GLUE QQP
    OUT/race/    train/ dev/ test/ (high/, middle/ of *.txt)         RACE
    OUT/squad1/  train-v1.1.json  (MLQA's English SQuAD 1.1 training file, via XGLUE)
                 dev-v1.1.json    (XQuAD's English file, the SQuAD 1.1 dev questions)
    OUT/squad2/  train-v2.0.json dev-v2.0.json   (CUAD, SQuAD 2.0 format, unanswerable
                                                  questions included)

The SQuAD-format files are as published: without a "version" key.  OUT/SOURCES.json says
where each file came from (archive, member, inner path), its sha256, its size in rows or
questions, and the licence its dataset card states.  A second run with every file in place
and unchanged does nothing.
"""

import argparse
import io
import json
import sys
import tarfile
import zipfile
from pathlib import Path

from megacommon.files import atomic_write_bytes, atomic_write_json, pip_download, sha256_file

PACKAGE = "datasets==1.18.4"
ARCHIVE = "datasets-1.18.4.tar.gz"
ARCHIVE_SHA256 = "8f28a7afc2f894c68cb017335a32812f443fe41bc59c089cbd15d7412d3f7f96"
ROOT = "datasets-1.18.4/datasets"

# task -> (dataset card[:its config], fixture zip under ROOT,
#          [(path in the zip, path under OUT/task)]).
# A path in the zip ending in "/" takes every *.txt below it (RACE's tree).
TASKS = {
    "mnli": (
        "glue",
        "glue/dummy/mnli/1.0.0/dummy_data.zip",
        [
            ("dummy_data/MNLI/train.tsv", "train.tsv"),
            ("dummy_data/MNLI/dev_matched.tsv", "dev_matched.tsv"),
            ("dummy_data/MNLI/dev_mismatched.tsv", "dev_mismatched.tsv"),
        ],
    ),
    "qqp": (
        "glue",
        "glue/dummy/qqp/1.0.0/dummy_data.zip",
        [("dummy_data/QQP/train.tsv", "train.tsv"), ("dummy_data/QQP/dev.tsv", "dev.tsv")],
    ),
    "race": (
        "race",
        "race/dummy/all/0.1.0/dummy_data.zip",
        [(f"dummy_data/RACE/{split}/", split) for split in ("train", "dev", "test")],
    ),
    "squad1": (
        "xglue:mlqa",
        "xglue/dummy/mlqa/1.0.0/dummy_data.zip",
        [
            (
                "dummy_data/xglue_full_dataset.tar.gz/xglue_full_dataset/MLQA/squad1.1/"
                "train-v1.1.json",
                "train-v1.1.json",
            )
        ],
    ),
    "squad1-dev": (
        "xquad",
        "xquad/dummy/xquad.en/1.0.0/dummy_data.zip",
        [("dummy_data/xquad.en.json", "dev-v1.1.json")],
    ),
    "squad2": (
        "cuad",
        "cuad/dummy/1.0.0/dummy_data.zip",
        [
            ("dummy_data/data.zip/train_separate_questions.json", "train-v2.0.json"),
            ("dummy_data/data.zip/test.json", "dev-v2.0.json"),
        ],
    ),
}
# What the task's authors say beside the card's `licenses` field (the cards of GLUE and RACE
# give the benchmark's, or none).
LICENCE_NOTES = {
    "mnli": "MultiNLI: OANC text and other permissive licences, per its authors",
    "qqp": "Quora Question Pairs: Quora's terms of service (non-commercial use)",
    "race": "RACE: for non-commercial research purposes only, per its authors",
    "squad1": "MLQA's SQuAD v1.1 training file: SQuAD is CC BY-SA 4.0",
    "squad1-dev": "XQuAD: CC BY-SA 4.0",
    "squad2": "CUAD: CC BY 4.0",
}


def _fail(message: str) -> int:
    print(f"fetch_finetune_data: {message}", file=sys.stderr)
    return 1


def _card_licences(tar: tarfile.TarFile, card: str, config: str) -> object:
    """The `licenses` field of a dataset card's YAML header (a list; the config's where the
    card gives one per config)."""
    text = tar.extractfile(f"{ROOT}/{card}/README.md").read().decode("utf-8")
    header = text.split("---")[1] if text.startswith("---") else ""
    lines = header.splitlines()
    if "licenses:" not in lines:
        return None
    found: dict[str, list[str]] = {}
    key = ""
    for line in lines[lines.index("licenses:") + 1 :]:
        if not line.startswith(" ") and not line.startswith("-"):
            break
        if line.startswith("- "):
            found.setdefault("", []).append(line[2:].strip())
        elif line.strip().startswith("- "):
            found.setdefault(key, []).append(line.strip()[2:])
        else:
            key = line.strip().rstrip(":")
    return found.get("", found.get(config, found))


def _count(path: Path) -> dict:
    if path.suffix == ".tsv":
        return {"rows": max(0, len(path.read_text(encoding="utf-8").splitlines()) - 1)}
    if path.suffix in (".json", ".txt"):  # SQuAD files; RACE passages are JSON in *.txt
        data = json.loads(path.read_text(encoding="utf-8"))
        if isinstance(data, dict) and "data" in data:  # SQuAD
            qas = [q for a in data["data"] for p in a["paragraphs"] for q in p["qas"]]
            counts = {"articles": len(data["data"]), "questions": len(qas)}
            if any("is_impossible" in q for q in qas):
                counts["unanswerable"] = sum(bool(q.get("is_impossible")) for q in qas)
            return counts
        return {"questions": len(data.get("questions", []))}  # a RACE passage
    return {}


def _extract(tar: tarfile.TarFile, out: Path) -> dict:
    sources = {}
    for name, (card_config, fixture, files) in TASKS.items():
        task = name.removesuffix("-dev")
        card, _, config = card_config.partition(":")
        zipped = zipfile.ZipFile(io.BytesIO(tar.extractfile(f"{ROOT}/{fixture}").read()))
        members = [m for m in zipped.namelist() if not m.startswith("__MACOSX/")]
        entries = []
        for inner, target in files:
            if inner.endswith("/"):  # a tree: its *.txt files, by their place below `inner`
                pairs = [
                    (m, f"{target}/{m[len(inner) :]}")
                    for m in sorted(members)
                    if m.startswith(inner) and m.endswith(".txt")
                ]
            else:
                pairs = [(inner, target)]
            for member, relative in pairs:
                path = out / task / relative
                path.parent.mkdir(parents=True, exist_ok=True)
                atomic_write_bytes(path, zipped.read(member))
                entries.append(
                    {
                        "file": f"{task}/{relative}",
                        "sha256": sha256_file(path),
                        **_count(path),
                        "from": " > ".join((ARCHIVE, f"{ROOT}/{fixture}", member)),
                    }
                )
        sources[name] = {
            "dataset_card": f"{ROOT}/{card}/README.md",
            "card_licenses": _card_licences(tar, card, config),
            "licence_note": LICENCE_NOTES[name],
            "files": entries,
        }
    return sources


def _in_place(out: Path) -> bool:
    try:
        sources = json.loads((out / "SOURCES.json").read_text())
        files = [f for s in sources["tasks"].values() for f in s["files"]]
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return bool(files) and all(
        (out / f["file"]).is_file() and sha256_file(out / f["file"]) == f["sha256"] for f in files
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("data/finetune"))
    parser.add_argument("--cache", type=Path, default=Path("data/downloads"))
    args = parser.parse_args()
    out = args.out
    if _in_place(out):
        print(f"fine-tuning samples: already in {out} (SOURCES.json says where from)")
        return 0
    archive = pip_download(PACKAGE, ARCHIVE, ARCHIVE_SHA256, args.cache, binary=False)
    if isinstance(archive, str):
        return _fail(archive)
    try:
        with tarfile.open(archive) as tar:
            sources = _extract(tar, out)
    except (KeyError, tarfile.TarError, zipfile.BadZipFile) as e:
        return _fail(f"{archive}: not the layout this script knows ({e})")
    record = {
        "package": PACKAGE,
        "archive": ARCHIVE,
        "archive_sha256": ARCHIVE_SHA256,
        "note": f"pip download --no-deps --no-binary :all: {PACKAGE}: the test fixtures of "
        "the datasets library, real rows of each task in its official format, bytes unchanged",
        "tasks": sources,
    }
    atomic_write_json(out / "SOURCES.json", record)
    for name, source in sources.items():
        sizes = [
            f"{f['file']} ({', '.join(f'{v} {k}' for k, v in f.items() if isinstance(v, int))})"
            for f in source["files"]
        ]
        if name == "race":
            sizes = [f"race/ ({len(sizes)} passages)"]
        print(f"{name:10s} {', '.join(sizes)}")
    print(f"fine-tuning samples -> {out} (where each came from and its licence: SOURCES.json)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
