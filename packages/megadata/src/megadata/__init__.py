"""Corpus builder: raw documents to deduplicated, tokenized Arrow shards. Imports no torch."""

from importlib.metadata import version

__version__ = version("megadata")
