"""Files written whole or not at all, their sha256, and files from the package index."""

import contextlib
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

_HASH_CHUNK = 1 << 20


def sha256_file(path: str | Path) -> str:
    """The hex sha256 of a file, read in 1 MiB pieces (a shard of any size)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


@contextlib.contextmanager
def atomic_writer(path: str | Path, durable: bool = True) -> Iterator[BinaryIO]:
    """A binary file whose contents appear at `path` when the block ends, complete (or not
    at all, if it raises); on disk by then unless not `durable` (a file whose loss after a
    power cut only means redoing some work).  For a file too large to hold in memory."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            if durable:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_bytes(path: str | Path, data: bytes, durable: bool = True) -> None:
    """`data` at `path`, complete or not at all (`atomic_writer`)."""
    with atomic_writer(path, durable) as f:
        f.write(data)


def atomic_write_json(
    path: str | Path, obj, durable: bool = True, *, sort_keys: bool = True
) -> None:
    """`obj` as indented JSON with a final newline, complete or not at all."""
    data = (json.dumps(obj, indent=2, sort_keys=sort_keys) + "\n").encode()
    atomic_write_bytes(path, data, durable)


def pip_download(
    requirement: str, filename: str, sha256: str, cache: str | Path, *, binary: bool = True
) -> Path | str:
    """`filename`, the wheel (or, `binary=False`, the source archive) of `requirement` that
    pip downloads from the package index into `cache`, checked against its `sha256`; kept
    there, so a second call downloads nothing.  Or why it could not be had, as a sentence."""
    path = Path(cache) / filename
    if path.is_file() and sha256_file(path) == sha256:
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    only = ["--only-binary", ":all:"] if binary else ["--no-binary", ":all:"]
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", *only]
    cmd += ["-d", str(path.parent), requirement]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    kind = "wheel" if binary else "source archive"
    if proc.returncode != 0 or not path.is_file():
        return (
            f"pip could not download the {kind} of {requirement} "
            f"({proc.stderr.strip()[-300:]}); check the package index settings (PIP_INDEX_URL)"
        )
    if sha256_file(path) != sha256:
        path.unlink()
        return f"{path} has another sha256 than {requirement}'s published {kind}; removed it"
    return path
