"""Zero-shot evaluation (WikiText103, LAMBADA) and fine-tuning of megatrain checkpoints."""

from importlib.metadata import version

__version__ = version("megaeval")
