"""The `megaeval` command: the paper's evaluations of a megatrain checkpoint."""

from __future__ import annotations

import json
import os
from collections.abc import Callable

import click

from megacommon.errors import FAILURE, CommandError
from megaeval import __version__
from megaeval.errors import EvalDataError, EvalSettingsError


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="megaeval")
def main() -> None:
    """Evaluate megatrain checkpoints as the paper did: WikiText103
    perplexity, LAMBADA cloze accuracy, and BERT fine-tuning (MNLI, QQP, SQuAD, RACE).

    Run `megaeval COMMAND --help` for one evaluation.
    """


def apply_options(command: Callable, options: list[Callable]) -> Callable:
    for option in reversed(options):
        command = option(command)
    return command


def model_options(command: Callable) -> Callable:
    """--ckpt / --hf: which model to evaluate (shared by the tasks)."""
    options = [
        click.option(
            "--ckpt",
            type=click.Path(exists=True, file_okay=False),
            default=None,
            help="A megatrain checkpoint directory (the one holding `latest`).",
        ),
        click.option(
            "--hf",
            type=click.Path(exists=True, file_okay=False),
            default=None,
            help="A Hugging Face causal LM directory (save_pretrained; needs megaeval[hf]).",
        ),
    ]
    return apply_options(command, options)


def run_options(command: Callable) -> Callable:
    """How to run the model and where the results go (shared by the tasks)."""
    options = [
        click.option(
            "--tp",
            type=click.IntRange(min=1),
            default=1,
            show_default=True,
            help="Tensor-parallel size to run a --ckpt model at.",
        ),
        click.option(
            "--pp",
            type=click.IntRange(min=1),
            default=1,
            show_default=True,
            help="Pipeline-parallel size to run a --ckpt model at (at most its layers; where "
            "it does not divide them, the first stages take a layer more).",
        ),
        click.option(
            "--cp",
            type=click.IntRange(min=1),
            default=1,
            show_default=True,
            help="Context-parallel size: each sequence of a --ckpt model split over this many "
            "workers (the same numbers as without).",
        ),
        click.option(
            "--device",
            default=None,
            help="Torch device for --hf, e.g. cpu, cuda:0 [default: cuda if available, else cpu].",
        ),
        click.option(
            "--dtype",
            type=click.Choice(["float32", "float64", "bfloat16", "float16"]),
            default=None,
            help="Weights' dtype for --hf [default: float32].",
        ),
        click.option(
            "--batch-size",
            type=click.IntRange(min=1),
            default=8,
            show_default=True,
            help="Sequences per model call.",
        ),
        click.option(
            "--json",
            "json_out",
            type=click.Path(dir_okay=False),
            default=None,
            help="Also write the results to this JSON file.",
        ),
        click.option("--no-progress", is_flag=True, help="Do not show a progress bar."),
        click.option(
            "--force",
            is_flag=True,
            help="Evaluate even when --json holds this evaluation's result for the same "
            "checkpoint iteration, data file and settings (otherwise reused).",
        ),
    ]
    return apply_options(command, options)


def cache_key(task: str, model: dict, data: str, settings: dict) -> dict | None:
    """What a --ckpt evaluation's result depends on: the checkpoint (the iteration `latest`
    names, and its meta.json's digest, which changes with any retraining), the data file's
    digest and the settings that change the numbers.  Read without torch, in milliseconds."""
    if model["ckpt"] is None:
        return None
    from megacommon.files import sha256_file
    from megatrain.checkpoint.files import CheckpointError, find_checkpoint, read_meta

    try:
        directory = find_checkpoint(model["ckpt"])
        iteration = read_meta(directory)["iteration"]
    except CheckpointError:
        return None  # loading will say what is wrong
    return {
        "task": task,
        "checkpoint": str(directory.resolve()),
        "iteration": iteration,
        "meta_sha256": sha256_file(directory / "meta.json"),
        "data_sha256": sha256_file(data),
        "settings": settings,
    }


def reused_result(key: dict | None, json_out: str | None, force: bool) -> dict | None:
    """The result --json already holds for `key`, unless --force; None: evaluate."""
    if key is None or not json_out or force or not os.path.isfile(json_out):
        return None
    try:
        with open(json_out) as f:
            result = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(result, dict) or result.get("cache_key") != key:
        return None
    click.echo(
        f"megaeval {key['task']}: reused {json_out} (checkpoint iteration {key['iteration']}, "
        "same data file and settings; --force evaluates again)"
    )
    return result


def check_data(read: Callable, path: str) -> None:
    """Read the data file before any model is loaded, so bad input fails in a second."""
    try:
        read(path)
    except EvalDataError as e:
        raise CommandError(f"--data: {e}") from None


def check_model_flags(model: dict) -> None:
    """Exactly one model source, and only the flags that apply to it."""
    ckpt, hf = model["ckpt"], model["hf"]
    if (ckpt is None) == (hf is None):
        raise CommandError("give exactly one of --ckpt DIR or --hf DIR")
    if hf is not None and (model["tp"], model["pp"], model["cp"]) != (1, 1, 1):
        raise CommandError("--tp/--pp/--cp apply to --ckpt only; an --hf model runs in one process")
    if ckpt is not None and (model["device"] or model["dtype"]):
        raise CommandError("--device/--dtype apply to --hf only")


def run_evaluation(task: str, evaluate: Callable, model: dict, **kwargs) -> dict:
    """Evaluate the --ckpt or --hf model with `evaluate(scorer, **kwargs)`.

    A checkpoint is evaluated by megaeval.checkpoint_scorer, which runs the same
    `evaluate` in each of its workers with a distributed scorer.
    """
    ckpt, hf = model["ckpt"], model["hf"]
    try:
        if ckpt is not None:
            from megaeval.checkpoint_scorer import evaluate_checkpoint
            from megatrain.run.launch import LaunchError

            try:
                layout = {k: model[k] for k in ("tp", "pp", "cp")}
                return evaluate_checkpoint(task, ckpt, **layout, **kwargs)
            except LaunchError as e:  # a worker failed: its error, without the traceback
                raise CommandError(str(e), FAILURE) from None
        from megaeval.scoring import HFScorer

        device = model["device"]
        if device is None:
            import torch

            device = "cuda" if torch.cuda.is_available() else "cpu"
        if not kwargs.get("progress", True):  # --no-progress: transformers' bars too
            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()
        scorer = HFScorer(hf, device=device, dtype=model["dtype"] or "float32")
        return evaluate(scorer, **kwargs)
    except EvalSettingsError as e:
        raise CommandError(str(e)) from None
    except EvalDataError as e:
        raise CommandError(str(e)) from None


def report(
    title: str,
    rows: list[tuple[str, str]],
    result: dict,
    json_out: str | None,
    key: dict | None = None,
) -> None:
    """Print a small table of the results and write them to --json (with the `cache_key`
    that lets the same evaluation reuse them)."""
    click.echo(title)
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        click.echo(f"  {name:<{width}}  {value}")
    if json_out and not (key and result.get("cache_key") == key):  # not reused
        os.makedirs(os.path.dirname(os.path.abspath(json_out)), exist_ok=True)
        with open(json_out, "w") as f:
            json.dump({**result, "cache_key": key} if key else result, f, indent=2)
            f.write("\n")
        click.echo(f"results written to {json_out}")


@main.command("wikitext103")
@model_options
@click.option(
    "--data",
    type=click.Path(dir_okay=False),
    required=True,
    help="The raw WikiText103 test file (wiki.test.tokens).",
)
@click.option(
    "--seq-len",
    type=click.IntRange(min=1),
    default=1024,
    show_default=True,
    help="Tokens per window.",
)
@click.option(
    "--stride",
    type=click.IntRange(min=1),
    default=32,
    show_default=True,
    help="Tokens between window starts; each later window scores only its last --stride.",
)
@run_options
def wikitext103_command(data, seq_len, stride, batch_size, json_out, no_progress, force, **model):
    """WikiText103 perplexity with overlapping windows, and the paper's adjusted
    perplexity (loss normalised by the raw file's word count)."""
    from megaeval.wikitext import check_window_settings, evaluate_wikitext, read_wikitext

    check_model_flags(model)
    check_data(read_wikitext, data)
    try:
        check_window_settings(seq_len, stride)
    except EvalSettingsError as e:
        raise CommandError(str(e)) from None
    key = cache_key("wikitext103", model, data, {"seq_len": seq_len, "stride": stride})
    result = reused_result(key, json_out, force) or run_evaluation(
        "wikitext103",
        evaluate_wikitext,
        model,
        data_path=data,
        seq_len=seq_len,
        stride=stride,
        batch_size=batch_size,
        progress=not no_progress,
    )
    rows = [
        ("T_o (raw words)", str(result["T_o"])),
        ("T (tokens)", str(result["T"])),
        (
            "windows",
            f"{result['windows']} (seq_len {result['seq_len']}, stride {result['stride']})",
        ),
        ("mean loss", f"{result['mean_loss']:.4f}"),
        ("perplexity", f"{result['ppl']:.3f}"),
        ("adjusted perplexity", f"{result['adjusted_ppl']:.3f}"),
    ]
    report(f"WikiText103  {data}", rows, result, json_out, key)


@main.command("lambada")
@model_options
@click.option(
    "--data",
    type=click.Path(dir_okay=False),
    required=True,
    help='The LAMBADA test file: one {"text": ...} per line (lambada_test.jsonl).',
)
@click.option(
    "--strict/--no-strict",
    default=True,
    show_default=True,
    help="Strict: every subword token of the last word must be predicted; "
    "no-strict: only the passage's last token.",
)
@run_options
def lambada_command(data, strict, batch_size, json_out, no_progress, force, **model):
    """LAMBADA cloze accuracy: the last word of each passage predicted under
    teacher forcing."""
    from megaeval.lambada import evaluate_lambada, read_lambada

    check_model_flags(model)
    check_data(read_lambada, data)
    key = cache_key("lambada", model, data, {"strict": strict})
    result = reused_result(key, json_out, force) or run_evaluation(
        "lambada",
        evaluate_lambada,
        model,
        data_path=data,
        strict=strict,
        batch_size=batch_size,
        progress=not no_progress,
    )
    rows = [
        ("examples", str(result["examples"])),
        ("mode", "strict (whole last word)" if result["strict"] else "last token"),
        ("accuracy", f"{100 * result['accuracy']:.2f}% ({result['correct']} correct)"),
        ("target tokens", str(result["target_tokens"])),
        ("target perplexity", f"{result['target_ppl']:.3f}"),
    ]
    report(f"LAMBADA  {data}", rows, result, json_out, key)


FINETUNE_DATA = {  # what --data must hold, per task
    "mnli": ("train.tsv", "dev_matched.tsv", "dev_mismatched.tsv"),
    "qqp": ("train.tsv", "dev.tsv"),
    "squad1": ("train-v1.1.json", "dev-v1.1.json"),
    "squad2": ("train-v2.0.json", "dev-v2.0.json"),
    "race": ("train", "dev", "test"),
}


@main.command("finetune")
@click.argument("task", type=click.Choice(sorted(FINETUNE_DATA)))
@click.option(
    "--ckpt",
    required=True,
    type=click.Path(exists=True, file_okay=False),
    help="A megatrain BERT checkpoint (pretrained, `import-hf`ed, or fine-tuned with --eval-only).",
)
@click.option(
    "--data",
    required=True,
    type=click.Path(exists=True, file_okay=False),
    help="The task's directory in its official format (GLUE MNLI/QQP TSVs, SQuAD JSONs, "
    "the RACE tree).",
)
@click.option(
    "--out",
    type=click.Path(file_okay=False),
    default=None,
    help="Results, predictions and checkpoints (OUT/ckpt, resumed) [default: runs/finetune-TASK].",
)
@click.option("--tp", type=click.IntRange(min=1), default=1, show_default=True)
@click.option("--pp", type=click.IntRange(min=1), default=1, show_default=True)
@click.option("--dp", type=click.IntRange(min=1), default=1, show_default=True,
              help="Data-parallel replicas (workers = tp x pp x dp).")  # fmt: skip
@click.option("--batch-size", type=click.IntRange(min=1), default=None,
              help="Examples per step [default: Table 6].")  # fmt: skip
@click.option("--lr", type=float, default=None, help="[default: Table 6]")
@click.option("--epochs", type=click.IntRange(min=1), default=None, help="[default: Table 6]")
@click.option("--max-seq-length", type=click.IntRange(min=8), default=None,
              help="[default: 128 MNLI/QQP, 384 SQuAD, 512 RACE]")  # fmt: skip
@click.option("--micro-batch-size", type=click.IntRange(min=1), default=4, show_default=True,
              help="Examples per microbatch.")  # fmt: skip
@click.option("--warmup", type=float, default=0.1, show_default=True,
              help="Fraction of the iterations the learning rate warms up over.")  # fmt: skip
@click.option("--dropout", type=float, default=0.1, show_default=True)
@click.option("--seed", type=int, default=1234, show_default=True)
@click.option("--precision", type=click.Choice(["fp32", "bf16", "fp16"]), default=None,
              help="[default: bf16 on a GPU, fp32 on a CPU]")  # fmt: skip
@click.option("--eval-only", is_flag=True, help="Score --ckpt (a fine-tuned one) on dev.")
@click.option("--max-train-examples", type=click.IntRange(min=1), default=None,
              help="Train on the first N examples only (a quick look).")  # fmt: skip
@click.option("--max-eval-examples", type=click.IntRange(min=1), default=None)
@click.option("--exit-interval", type=click.IntRange(min=1), default=None,
              help="Save and stop at the first iteration that is a multiple of it; the same "
              "command resumes from OUT/ckpt.")  # fmt: skip
def finetune_command(task, ckpt, data, out, dp, **settings):
    """Fine-tune a BERT checkpoint on TASK (mnli, qqp, squad1, squad2, race) as the paper
    did (Table 6's batch size, learning rate and epochs for the nearest model size; warm-up
    then linear decay; dropout 0.1), on tp x pp x dp workers, scoring the dev splits after
    every epoch as the official scripts score them.  Writes OUT/metrics.json,
    OUT/predictions*.json (question id -> answer text; example id -> label) and OUT/ckpt."""
    from pathlib import Path

    from megaeval.finetune.engine import Settings, finetune, plan
    from megatrain.checkpoint.files import CheckpointError, find_checkpoint, read_meta
    from megatrain.inference.load import load_tokenizer, require_kind
    from megatrain.run import launch

    missing = [f for f in FINETUNE_DATA[task] if not (Path(data) / f).exists()]
    if settings["eval_only"]:
        missing = [f for f in missing if not f.startswith("train")]
    if missing:
        raise CommandError(f"--data {data}: no {', '.join(missing)} (the {task} files)")
    try:
        directory = find_checkpoint(ckpt)
        meta = read_meta(directory)
        require_kind(meta, "bert", f"megaeval finetune {task}", directory)
        load_tokenizer(directory, meta)
    except CheckpointError as e:
        raise CommandError(f"--ckpt: {e}") from None
    try:  # the settings against the checkpoint and the layout, before any worker starts
        plan(task, meta, Settings(**settings), dp)
    except ValueError as e:
        raise CommandError(str(e)) from None
    out = out or f"runs/finetune-{task}"
    workers = settings["tp"] * settings["pp"] * dp
    try:
        args = (task, ckpt, data, out, Settings(**settings))
        results = launch.run_workers(finetune, args, workers)
    except (launch.LaunchError, ValueError) as e:
        raise CommandError(str(e), FAILURE) from None
    result = (results[0] or {}).get("metrics") or {}
    rows = [
        (f"{split} {name}", f"{value:.4f}" if isinstance(value, float) else str(value))
        for split, metrics in result.items()
        for name, value in metrics.items()
    ]
    report(f"finetune {task}  {ckpt} -> {out}", rows or [("results", "none")], result, None)


if __name__ == "__main__":  # `python -m megaeval.cli`: messages still say "megaeval COMMAND: ..."
    main(prog_name="megaeval")
