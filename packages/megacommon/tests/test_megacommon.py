"""The shared helpers: atomic writes, sha256, command errors, and the corpus format's writer
and reader agreeing with each other and refusing what the format does not allow."""

import hashlib
import json
import subprocess

import click
import pyarrow as pa
import pytest
from click.testing import CliRunner

from megacommon import corpus_format as cf
from megacommon.errors import FAILURE, USAGE_OR_INPUT, CommandError
from megacommon.files import (
    atomic_write_bytes,
    atomic_write_json,
    atomic_writer,
    pip_download,
    sha256_file,
)


def test_sha256_file_reads_in_pieces(tmp_path):
    data = bytes(range(256)) * 9000  # over one 1 MiB piece
    (tmp_path / "f").write_bytes(data)
    assert sha256_file(tmp_path / "f") == hashlib.sha256(data).hexdigest()


def test_atomic_writer_leaves_nothing_when_it_raises(tmp_path):
    target = tmp_path / "sub" / "out.bin"
    atomic_write_bytes(target, b"old")

    def killed_while_writing():
        with atomic_writer(target) as f:
            f.write(b"half of the new")
            raise RuntimeError("killed")

    with pytest.raises(RuntimeError):
        killed_while_writing()
    assert target.read_bytes() == b"old"
    assert sorted(p.name for p in target.parent.iterdir()) == ["out.bin"]  # no temporary left


def test_atomic_write_json_is_sorted_and_ends_with_a_newline(tmp_path):
    atomic_write_json(tmp_path / "a.json", {"b": 1, "a": [2]})
    assert (tmp_path / "a.json").read_text() == '{\n  "a": [\n    2\n  ],\n  "b": 1\n}\n'
    atomic_write_json(tmp_path / "b.json", {"b": 1, "a": 2}, sort_keys=False)
    assert list(json.loads((tmp_path / "b.json").read_text())) == ["b", "a"]


def test_pip_download_keeps_a_checked_file_and_removes_another(tmp_path, monkeypatch):
    """pip is not asked again for a file in the cache with its sha256; a download with
    another sha256 is removed and said (pip stood in for by a fake that writes bytes)."""
    calls = []

    def fake_pip(cmd, **_):
        calls.append(cmd)
        (tmp_path / "x-1.0-py3-none-any.whl").write_bytes(b"other bytes")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(subprocess, "run", fake_pip)
    good = hashlib.sha256(b"the wheel").hexdigest()
    said = pip_download("x==1.0", "x-1.0-py3-none-any.whl", good, tmp_path)
    assert "another sha256" in said and not (tmp_path / "x-1.0-py3-none-any.whl").exists()
    assert calls[0][-1] == "x==1.0" and "--only-binary" in calls[0]
    (tmp_path / "x-1.0-py3-none-any.whl").write_bytes(b"the wheel")
    assert pip_download("x==1.0", "x-1.0-py3-none-any.whl", good, tmp_path) == (
        tmp_path / "x-1.0-py3-none-any.whl"
    )
    assert len(calls) == 1


def test_command_error_names_the_command_and_its_exit_code():
    @click.group()
    def tool():
        pass

    @tool.command()
    @click.option("--broken", is_flag=True)
    def sub(broken):
        if broken:
            raise CommandError("the disk is full", FAILURE)
        raise CommandError("--size: expected a positive number")

    result = CliRunner().invoke(tool, ["sub"], prog_name="tool")
    assert result.exit_code == USAGE_OR_INPUT == 2
    assert result.output == "tool sub: --size: expected a positive number\n"
    result = CliRunner().invoke(tool, ["sub", "--broken"], prog_name="tool")
    assert (result.exit_code, result.output) == (FAILURE, "tool sub: the disk is full\n")
    assert CommandError("x", where="megadata").where == "megadata"


def _docs(n, dtype="uint16", ends=False):
    data = {
        "doc_id": [f"d{i}" for i in range(n)],
        "tokens": [[5] * (i + 1) + [0] for i in range(n)],
    }
    if ends:
        data["sentence_ends"] = [[i + 1] for i in range(n)]
    return pa.table(data, schema=cf.shard_schema(dtype, ends))


def test_written_corpus_reads_back(tmp_path):
    entries = []
    for i in range(2):
        file = cf.shard_file("train", i)
        entries.append({"file": file, **cf.write_shard(tmp_path / file, _docs(5, ends=True), 2)})
    path = cf.write_manifest(
        tmp_path,
        tokenizer={"kind": "bert-wordpiece", "eod_id": 0, "vocab_size": 30522},
        token_dtype=cf.token_dtype(30522),
        sentence_boundaries=True,
        splits={"train": entries, "valid": []},
    )
    manifest, where = cf.read_manifest(tmp_path)
    assert where == path and manifest["format_version"] == cf.FORMAT_VERSION
    train = manifest["splits"]["train"]
    assert (train["docs"], train["tokens"]) == (10, 2 * sum(range(2, 7)))
    assert manifest["splits"]["valid"] == {"docs": 0, "tokens": 0, "shards": []}
    shard = tmp_path / train["shards"][1]["file"]
    assert train["shards"][1]["sha256"] == sha256_file(shard)
    reader = pa.ipc.open_file(pa.memory_map(str(shard)))
    assert reader.num_record_batches == 3  # batches of 2 rows
    cf.check_shard_schema(reader.schema, shard, "uint16")
    assert reader.read_all().equals(_docs(5, ends=True))
    assert [cf.token_dtype(v) for v in (65536, 65537)] == ["uint16", "uint32"]


def test_reader_and_writer_refuse_what_the_format_does_not_allow(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"manifest.json: no corpus manifest; build"):
        cf.read_manifest(tmp_path)
    (tmp_path / "manifest.json").write_text("{")
    with pytest.raises(ValueError, match=r"manifest.json: not valid JSON"):
        cf.read_manifest(tmp_path)
    cf.write_manifest(
        tmp_path, tokenizer={}, token_dtype="uint16", sentence_boundaries=False, splits={},
        format_version=2,
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"manifest.json: format_version is 2, expected 1"):
        cf.read_manifest(tmp_path)
    with pytest.raises(ValueError, match=r"field 'splits.train' is missing"):
        cf.manifest_field({"splits": {}}, "m.json", "splits", "train")
    bad = pa.table({"doc_id": ["a"], "tokens": [[1.5]]})
    with pytest.raises(ValueError, match=r"x.arrow: column 'tokens' is list<item: double>"):
        cf.write_shard(tmp_path / "x.arrow", bad)
    assert not (tmp_path / "x.arrow").exists()
    with pytest.raises(ValueError, match=r"expected list<uint32> \(token_dtype of m.json\)"):
        cf.check_shard_schema(_docs(1).schema, "s.arrow", "uint32", "m.json")
    ends = pa.table({"doc_id": ["a"], "tokens": pa.array([[0]], pa.list_(pa.uint16())),
                     "sentence_ends": pa.array([[1]], pa.list_(pa.int64()))})  # fmt: skip
    with pytest.raises(ValueError, match=r"column 'sentence_ends' is list<item: int64>"):
        cf.write_shard(tmp_path / "y.arrow", ends)
