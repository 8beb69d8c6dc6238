"""GPT-2 and BERT models and their training loop, built on megacore."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("megatrain")
except PackageNotFoundError:  # run from the source tree (PYTHONPATH), not installed
    __version__ = "0+source"
