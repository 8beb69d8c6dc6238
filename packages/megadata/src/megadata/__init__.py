"""Corpus builder: raw documents to deduplicated, tokenized Arrow shards. Imports no torch."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("megadata")
except PackageNotFoundError:  # run from the source tree (PYTHONPATH), not installed
    __version__ = "0+source"
