"""Zero-shot evaluation (WikiText103, LAMBADA) and fine-tuning of megatrain checkpoints."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("megaeval")
except PackageNotFoundError:  # run from the source tree (PYTHONPATH), not installed
    __version__ = "0+source"
