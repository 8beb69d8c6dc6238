"""The `megadata` command: one subcommand per corpus stage, plus `run` for the whole recipe."""

import logging
import sys

import click

from megacommon.errors import CommandError
from megadata import __version__
from megadata.crawl import crawl_command
from megadata.recipe import (
    STAGES,
    RecipeError,
    claim_output,
    cluster_start,
    finished_run,
    load_recipe,
    record_start,
    run_recipe,
    run_stage,
)
from megadata.runner import Runner, format_table
from megadata.stages.decontaminate import overlap_command

_recipe = click.option(
    "--recipe",
    "recipe_path",
    required=True,
    type=click.Path(dir_okay=False),
    help="Recipe TOML file.",
)
_output = click.option(
    "--output", type=click.Path(file_okay=False), help="Corpus directory (default: the recipe's)."
)
_workers = click.option(
    "--workers", default=2, show_default=True, type=int, help="Worker processes."
)
_scheduler = click.option(
    "--scheduler",
    metavar="ADDRESS",
    help="Run the tasks on this Dask cluster (tcp://host:8786; it must see the corpus "
    "directory on a shared filesystem). Default: a local cluster of --workers processes.",
)
_quiet = click.option("--no-progress", is_flag=True, help="No progress bars.")


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="megadata")
def main() -> None:
    """Build a training corpus: raw documents in, deduplicated and tokenized
    Arrow shards out (the corpus directory that megatrain reads).

    Run `megadata COMMAND --help` for one stage.
    """
    logging.basicConfig(level=logging.WARNING, format="megadata: %(message)s", stream=sys.stderr)


def _fail(e: Exception):
    raise CommandError(str(e)) from None


@main.command()
@_recipe
@_output
@_workers
@_scheduler
@_quiet
def run(recipe_path, output, workers, scheduler, no_progress):
    """Run every stage of a recipe (each resumes where it stopped) and print a table."""
    try:
        recipe = load_recipe(recipe_path, output)
        results = finished_run(recipe)
        if results is not None:
            click.echo(
                f"megadata run: {recipe.output} is complete; nothing to do (the table is the run "
                "that built it; delete the directory or change --output to build again)"
            )
        else:
            results = run_recipe(
                recipe, workers=workers, progress=not no_progress, scheduler=scheduler
            )
    except (RecipeError, ValueError, FileNotFoundError) as e:
        _fail(e)
    start = cluster_start(recipe)
    click.echo(format_table(([start] if start else []) + results))
    click.echo(
        f"corpus: {recipe.output}  (manifest.json, tokenizer.json, train/, valid/, reports/)"
    )


def _stage_command(stage: str, help_text: str):
    @_recipe
    @_output
    @_workers
    @_scheduler
    @_quiet
    def command(recipe_path, output, workers, scheduler, no_progress):
        try:
            recipe = load_recipe(recipe_path, output)
            claim_output(recipe)
            with Runner(workers, not no_progress, scheduler) as runner:
                start = runner.start()
                record_start(recipe, start)
                stats = run_stage(recipe, stage, runner)
        except (RecipeError, ValueError, FileNotFoundError) as e:
            _fail(e)
        click.echo(format_table(([start] if start else []) + [stats]))

    command.__doc__ = help_text
    main.command(name=stage)(command)


for _stage, _help in zip(
    STAGES,
    (
        "Read the recipe's sources (txt, jsonl, HTML, Wikipedia XML) into partitions.",
        "Fix unicode (ftfy), keep English (clean.detector), join broken lines per source.",
        "Load the recipe's tokenizer files, or train one on the cleaned text.",
        "Drop documents shorter than filter.min_tokens tokens (default 128).",
        "Remove near-duplicates: MinHash LSH, verified Jaccard > dedup.threshold.",
        "Hold out 1 in holdout.every documents; write eval/wiki.test.tokens, lambada.jsonl.",
        "Remove test articles from training; report each eval set's 8-gram overlap.",
        "Token ids per document, end-of-document id appended.",
        "Write train/ and valid/ Arrow shards (29:1 by document) and manifest.json.",
    ),
    strict=True,
):
    _stage_command(_stage, _help)
main.add_command(overlap_command)
main.add_command(crawl_command)


if __name__ == "__main__":  # `python -m megadata.cli`: messages still say "megadata COMMAND: ..."
    main(prog_name="megadata")
