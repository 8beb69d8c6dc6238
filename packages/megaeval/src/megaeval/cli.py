"""The `megaeval` command: the paper's evaluations of a megatrain checkpoint."""

import click

from megaeval import __version__


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="megaeval")
def main() -> None:
    """Evaluate megatrain checkpoints as the paper did: WikiText103
    perplexity, LAMBADA cloze accuracy, and fine-tuning tasks.

    Run `megaeval COMMAND --help` for one evaluation.
    """
