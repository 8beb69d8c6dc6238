"""The `megadata` command: one subcommand per corpus stage, plus the recipe runner."""

import click

from megadata import __version__


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="megadata")
def main() -> None:
    """Build a training corpus: raw documents in, deduplicated and tokenized
    Arrow shards out (the corpus directory that megatrain reads).

    Run `megadata COMMAND --help` for one stage.
    """
