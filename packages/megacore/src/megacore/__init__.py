"""Parallel runtime: process groups, tensor/pipeline/data parallelism, optimizers, checkpoints."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("megacore")
except PackageNotFoundError:  # run from the source tree (PYTHONPATH), not installed
    __version__ = "0+source"
