"""Parallel runtime: process groups, tensor/pipeline/data parallelism, optimizers, checkpoints."""

from importlib.metadata import version

__version__ = version("megacore")
