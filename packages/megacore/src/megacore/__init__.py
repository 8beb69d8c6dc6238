"""Parallel runtime: process groups, tensor/pipeline/data parallelism, optimizers, checkpoint I/O."""

from importlib.metadata import version

__version__ = version("megacore")
