"""GPT-2 and BERT models and their training loop, built on megacore."""

from importlib.metadata import version

__version__ = version("megatrain")
