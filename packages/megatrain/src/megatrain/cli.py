"""The `megatrain` command: train, resume, convert and export models."""

import click

from megatrain import __version__


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="megatrain")
def main() -> None:
    """Train GPT-2 and BERT models with tensor, pipeline and data parallelism
    on a megadata corpus.

    Run `megatrain COMMAND --help` for one command.
    """
