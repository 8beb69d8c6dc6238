"""The `megatrain` command: train, resume, convert and export models."""

import dataclasses
import os
import sys

import click

from megacommon.errors import FAILURE, CommandError
from megatrain import __version__
from megatrain.checkpoint.files import find_checkpoint
from megatrain.config import CAUSAL_KINDS, ConfigError, load_config, validate
from megatrain.plan.hardware import ATTENTION_CHOICES


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="megatrain")
def main() -> None:
    """Train GPT-2, BERT and Llama models with tensor, pipeline and data parallelism
    on a megadata corpus.

    Run `megatrain COMMAND --help` for one command.
    """


@main.command("run")
@click.option(
    "--config",
    "config_path",
    type=click.Path(dir_okay=False),
    default=None,
    help="A model/run config, e.g. pipelines/models/gpt2-tiny.toml, or the run.toml import-hf "
    "writes [default with --load: the checkpoint's own, from its meta.json].",
)
@click.argument("overrides", nargs=-1)
@click.option(
    "--nproc-per-node",
    type=click.IntRange(min=1),
    default=None,
    help="Worker processes on this node [default: tp x pp x dp of the config; "
    "else one per GPU; else tp x pp].",
)
@click.option(
    "--load",
    type=click.Path(file_okay=False),
    default=None,
    help="Resume from this checkpoint directory's `latest` (= checkpoint.load).",
)
@click.option(
    "--load-hf",
    type=click.Path(exists=True, file_okay=False),
    default=None,
    help="Start from this Hugging Face Llama-family model's files at the run's layout, each "
    "rank reading its own slices (= checkpoint.load_hf) [without --config: the model is the "
    "HF config.json's].",
)
@click.option(
    "--save",
    type=click.Path(file_okay=False),
    default=None,
    help="Save checkpoints here (= checkpoint.save).",
)
@click.option("--nnodes", type=click.IntRange(min=1), default=1, show_default=True)
@click.option("--node-rank", type=click.IntRange(min=0), default=0, show_default=True)
@click.option("--master-addr", default="127.0.0.1", show_default=True)
@click.option("--master-port", type=click.IntRange(1, 65535), default=29500, show_default=True)
@click.option(
    "--max-restarts",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="Times the elastic agent restarts all workers after one fails (killed, crashed, or "
    "timed out in a collective); they resume from the last checkpoint of --save, so set "
    "checkpoint.save_interval.",
)
@click.option(
    "--rdzv-timeout",
    type=click.IntRange(min=1),
    default=600,
    show_default=True,
    help="Seconds a node waits at --master-addr:--master-port for the other nodes (--nnodes > "
    "1) before giving up.",
)
@click.option(
    "--no-plan-check",
    is_flag=True,
    help="Do not warn when `megatrain plan`'s memory estimate of the layout exceeds 90% of "
    "this node's GPU memory (the check runs only where CUDA is).",
)
def run_command(
    config_path, overrides, nproc_per_node, load, load_hf, save, nnodes, node_rank, master_addr,
    master_port, max_restarts, rdzv_timeout, no_plan_check,
):  # fmt: skip
    """Train the model of --config on its corpus.

    With --load DIR and no --config the run config is the checkpoint's own (its meta.json;
    an imported model's names no corpus: pass data.corpus=DIR), the overrides applied on it;
    with --load-hf DIR and no --config, the model is the Hugging Face model's.

    OVERRIDES are section.field=value, e.g. training.train_iters=200
    parallel.tensor_model_parallel_size=2.  With no launcher this starts its own
    workers through torch.distributed's elastic agent; under torchrun or Slurm
    (one task per GPU) it joins the job from the environment.

    With --nnodes N, start one `megatrain run` per node with the same --master-addr and
    --master-port (node 0's address) and --node-rank 0..N-1 (scripts/slurm/ does so); the
    nodes name the run alike: $MEGATRAIN_RUN_ID, else the Slurm job's id, else that address.

    SIGINT (Ctrl-C) or SIGTERM: every rank finishes its iteration, saves and stops; the exit
    status is then 130 (SIGINT) or 143 (SIGTERM).  A second one kills the workers at once (the
    last complete checkpoint stays).
    """
    from megatrain.checkpoint.run_config import check_corpus_named, checkpoint_config
    from megatrain.run import launch, preflight

    try:
        given = (("load", load), ("load_hf", load_hf), ("save", save))
        flags = [f"checkpoint.{k}={v!r}" for k, v in given if v]
        if config_path is None and not load and not load_hf:
            raise ConfigError(
                "give --config FILE (a run config, e.g. pipelines/models/gpt2-tiny.toml, or the "
                "run.toml import-hf writes), or --load DIR to run the config of that checkpoint, "
                "or --load-hf DIR for a Hugging Face model's"
            )
        if config_path is None and load_hf and not load:
            from megatrain.config.load import apply_overrides
            from megatrain.hf.layout_load import hf_run_config

            config = hf_run_config(load_hf)
            apply_overrides(config, [*overrides, *flags])
        elif config_path is None:
            config = checkpoint_config(load, [*overrides, *flags])
        else:
            config = load_config(config_path, [*overrides, *flags])
        check_corpus_named(config, config_path)
        if launch.in_launched_job() or launch.adopt_slurm_environment():
            validate(config, int(os.environ["WORLD_SIZE"]))
            from megatrain.run.loop import StopSignal, train

            stop = StopSignal()
            train(config, stop)
            if stop.signum:  # saved and stopped: say so to the launcher or scheduler
                sys.exit(128 + stop.signum)
            return
        if node_rank >= nnodes:
            raise ConfigError(f"--node-rank {node_rank} must be below --nnodes {nnodes}")
        if max_restarts:
            preflight.check_restartable(config)
        finished = preflight.finished_iteration(config)
        if finished is not None:
            click.echo(
                f"megatrain run: nothing to do: {config.checkpoint.load} already holds iteration "
                f"{finished} of training.train_iters={config.training.train_iters} (raise "
                "training.train_iters to train on, or --save/--load elsewhere to start over)"
            )
            return
        nproc = nproc_per_node or preflight.default_nproc(config, nnodes)
        validate(config, nproc * nnodes)
        import torch

        preflight.check_gpus(nproc, torch.cuda.device_count() if torch.cuda.is_available() else 0)
        if config.training.cuda_graphs:  # the workers train on CUDA when there is one
            from megatrain.parallelize import check_cuda_graphs

            check_cuda_graphs(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
        warning = None if no_plan_check else preflight.plan_warning(config, nproc * nnodes)
        if warning:
            click.echo(f"megatrain run: warning: {warning}", err=True)
        preflight.check_inputs(config)
        config.data.verify_sha256 = False  # the shards were verified just now, for every worker
    except (ConfigError, ValueError, FileNotFoundError) as e:
        raise CommandError(str(e)) from None
    try:
        launch.launch(
            launch.train_worker,
            (config.to_dict(),),
            nproc_per_node=nproc,
            nnodes=nnodes,
            node_rank=node_rank,
            master_addr=master_addr,
            master_port=master_port,
            max_restarts=max_restarts,
            rdzv_timeout=rdzv_timeout,
        )
    except launch.Interrupted as e:
        click.echo(f"megatrain run: {e.describe(config.checkpoint.save)}", err=True)
        import gc

        gc.freeze()  # exit now, without collecting torch's objects first (seconds on a busy CPU)
        sys.exit(e.exit_code)
    except launch.LaunchError as e:
        raise CommandError(str(e), FAILURE) from None


@main.command("generate")
@click.option(
    "--ckpt", required=True, type=click.Path(file_okay=False), help="Checkpoint directory."
)
@click.option(
    "--prompt", "prompts", multiple=True, required=True, help="Text to continue (repeatable)."
)
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=64, show_default=True)
@click.option("--greedy", is_flag=True, help="Take the most likely token at each step.")
@click.option("--temperature", type=float, default=1.0, show_default=True)
@click.option("--top-k", type=click.IntRange(min=0), default=0, show_default=True, help="0: off.")
@click.option("--top-p", type=float, default=1.0, show_default=True, help="1.0: off.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option(
    "--tp",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Tensor-parallel workers to split the model over (any layout it was saved at).",
)
@click.option("--no-kv-cache", is_flag=True, help="Recompute the whole sequence each step.")
@click.option("--keep-going", is_flag=True, help="Do not stop at the end-of-document token.")
@click.option(
    "--speculative",
    type=click.Choice(["mtp"]),
    help="Greedy tokens drafted by the model's multi-token prediction depths and verified by "
    "the model (the same tokens); prints the drafts' acceptance rate.",
)
def generate_command(
    ckpt, prompts, max_new_tokens, greedy, temperature, top_k, top_p, seed, tp, no_kv_cache,
    keep_going, speculative,
):  # fmt: skip
    """Continue each --prompt with the model of --ckpt: greedy, or sampled with temperature,
    top-k and top-p, using a KV cache; with --speculative mtp, greedy drafted by the model's
    multi-token prediction depths."""
    from megatrain.checkpoint.files import CheckpointError, read_meta
    from megatrain.inference.generate import Sampling, generation_worker
    from megatrain.inference.load import check_layout, load_tokenizer, require_kind
    from megatrain.run import launch

    try:
        sampling = Sampling(
            max_new_tokens=max_new_tokens,
            greedy=greedy,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            seed=seed,
            stop_at_eod=not keep_going,
        )
        directory = find_checkpoint(ckpt)
        meta = read_meta(directory)
        require_kind(meta, CAUSAL_KINDS, "generation", directory)
        load_tokenizer(directory, meta)
        check_layout(meta, tp, 1, directory)
        complete = _speculative(speculative, greedy, no_kv_cache, meta, directory)
    except (CheckpointError, ValueError) as e:
        raise CommandError(str(e)) from None
    args = (str(ckpt), tp, list(prompts), dataclasses.asdict(sampling), not no_kv_cache, complete)
    try:
        results = launch.run_workers(generation_worker, args, tp)[0]
    except (launch.LaunchError, ValueError) as e:  # ValueError: one worker, in this process
        raise CommandError(str(e), FAILURE) from None
    for r in results:
        click.echo(f"--- prompt: {r['prompt']}")
        click.echo(r["prompt"] + r["text"])
        if "drafted" in r:
            rate = r["accepted"] / r["drafted"] if r["drafted"] else 0.0
            click.echo(
                f"--- speculative mtp: {r['accepted']} of {r['drafted']} drafts accepted "
                f"({rate:.1%}), {len(r['tokens'])} tokens"
            )


def _speculative(kind, greedy: bool, no_kv_cache: bool, meta: dict, directory):
    """`generate --speculative`'s draft-and-verify function (None: plain generation), refused
    before any worker starts where it cannot run."""
    if kind is None:
        return None
    from megatrain.inference.speculative import check_speculative, generate_speculative

    if not greedy or no_kv_cache:
        raise ValueError(
            "--speculative mtp is greedy draft-and-verify through the KV cache: give --greedy "
            "and not --no-kv-cache"
        )
    model = (meta.get("config") or {}).get("model") or {}
    where = f"the checkpoint {directory}"
    check_speculative(model.get("mtp_num_layers"), model.get("window_size"), where)
    return generate_speculative


DTYPE_CHOICES = ("float32", "bfloat16", "float16")


def verify_options(command):
    """The parity check's options of import-hf and export-hf (`megatrain.hf.verify`)."""
    options = [
        click.option(
            "--verify",
            is_flag=True,
            help="Then run HF's model and ours on a few hundred tokens and print max |Δ logit|, "
            "KL and top-1 agreement; exit 1 past --verify-tol.",
        ),
        click.option(
            "--verify-tol",
            type=click.FloatRange(min=0),
            help="Max |Δ logit| --verify passes at [0.01 in float32, 2 in bfloat16, 0.5 in "
            "float16].",
        ),
        click.option(
            "--verify-text",
            type=click.Path(exists=True, dir_okay=False),
            help="Text for --verify (its first 256 tokens) [a built-in English paragraph].",
        ),
        click.option(
            "--verify-dtype",
            type=click.Choice(DTYPE_CHOICES),
            help="What both models run in for --verify [float32; with --dtype, both models' "
            "weights rounded to it first, as the conversion rounded them].",
        ),
        click.option(
            "--verify-memory",
            type=click.FloatRange(min=0),
            help="GiB of host memory --verify may use; a model past it runs layer by layer "
            "[90% of the memory available].",
        ),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def _verify_requested(options: dict) -> bool:
    """Whether --verify was given; a --verify-* option without it is refused."""
    given = [k for k, v in options.items() if k != "verify" and v is not None]
    if given and not options["verify"]:
        names = ", ".join("--" + k.replace("_", "-") for k in given)
        raise CommandError(f"{names} go(es) with --verify")
    return options["verify"]


@main.command(
    "export-hf", short_help="Export a checkpoint as a Hugging Face GPT-2, BERT, Llama, Qwen or MoE."
)
@click.option(
    "--ckpt",
    required=True,
    type=click.Path(exists=True, file_okay=False),
    help="megatrain checkpoint directory (the one holding `latest`).",
)
@click.option("--out", required=True, type=click.Path(file_okay=False), help="Directory to write.")
@click.option("--dtype", type=click.Choice(DTYPE_CHOICES), default="float32", show_default=True)
@click.option(
    "--max-shard-size",
    default="5GB",
    show_default=True,
    help="Largest safetensors file, as transformers' max_shard_size (5GB, 500MB, 2GiB, bytes): "
    "model-0000i-of-0000N.safetensors with model.safetensors.index.json; one file is "
    "model.safetensors.",
)
@click.option(
    "--workers",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Processes writing the shards, each its share of the files (a Llama-family model).",
)
@verify_options
def export_hf_command(ckpt, out, dtype, max_shard_size, workers, **verify):
    """Write the GPT-2, BERT or Llama of --ckpt as a Hugging Face directory (config.json,
    model.safetensors or shards of --max-shard-size with their index, tokenizer files) that
    `AutoTokenizer` and
    `transformers.GPT2LMHeadModel.from_pretrained` load, for a BERT
    `MegatronBertForPreTraining` (block_order pre_ln) or `BertForPreTraining` (post_ln), for a
    Llama-kind model the class its switches make: `LlamaForCausalLM`, `Qwen2ForCausalLM`
    (add_qkv_bias), `Qwen3ForCausalLM` (qk_layernorm), and with num_moe_experts
    `MixtralForCausalLM`, `Qwen2MoeForCausalLM` (a shared expert) or `Qwen3MoeForCausalLM`.
    Needs transformers: pip install 'megatrain[hf]'.  --verify then compares the export's
    model with the checkpoint's (docs/checkpoints.md)."""
    from megatrain.hf import export_hf
    from megatrain.hf.common import return_freed_tensors

    check = _verify_requested(verify)
    try:
        return_freed_tensors()
        export_hf(ckpt, out, dtype, max_shard_size=max_shard_size, workers=workers)
    except (ValueError, ImportError) as e:
        raise CommandError(str(e)) from None
    click.echo(f"megatrain export-hf: wrote {out}")
    if check:
        from megatrain.hf.verify import cli_check

        cli_check(out, ckpt, {**verify, "rounded": dtype})


@main.command(
    "import-hf", short_help="Import a Hugging Face GPT-2, BERT, Llama, Qwen or MoE as a checkpoint."
)
@click.argument("hf_dir", type=click.Path(exists=True, file_okay=False))
@click.option(
    "--out",
    required=True,
    type=click.Path(file_okay=False),
    help="Checkpoint directory to write (iteration 0, weights only).",
)
@click.option(
    "--tokenizer",
    "tokenizer_file",
    type=click.Path(exists=True, dir_okay=False),
    default=None,
    help="Keep this tokenizer.json (e.g. the corpus's, so its sha256 matches), or for a BERT "
    "build it from this vocab.txt, instead of HF_DIR's vocab.json + merges.txt (GPT-2) or "
    "vocab.txt (BERT), else its tokenizer.json (the Llama family: always its tokenizer.json).",
)
@click.option(
    "--dtype",
    type=click.Choice(DTYPE_CHOICES),
    default=None,
    help="dtype of the stored weights [the files': bf16 stays bf16].",
)
@verify_options
def import_hf_command(hf_dir, out, tokenizer_file, dtype, **verify):
    """Write the GPT2LMHeadModel, BertForPreTraining, MegatronBertForPreTraining or
    LlamaForCausalLM (or a Mistral without a sliding window), Qwen2ForCausalLM,
    Qwen3ForCausalLM, MixtralForCausalLM, Qwen2MoeForCausalLM or Qwen3MoeForCausalLM of
    HF_DIR (config.json,
    model.safetensors or pytorch_model.bin, tokenizer) as a megatrain checkpoint of weights
    only, which `megatrain run --load OUT` fine-tunes from (iteration 0, fresh optimizer); a
    BERT becomes model.kind "bert", block_order post_ln (BERT) or pre_ln (MegatronBERT), a
    Llama-family model model.kind "llama" (read from safetensors only).

    Beside it, OUT/run.toml: the run config of the import ([model] as imported, [training],
    [optimizer], [parallel] to edit, [checkpoint] load = OUT), for `megatrain run --config
    OUT/run.toml` once its [data] corpus names a corpus built with the model's tokenizer.

    --verify then compares HF_DIR's model with the checkpoint's (docs/checkpoints.md) and writes
    the report into OUT's meta.json (imported_from.verify)."""
    from megatrain.checkpoint.run_config import write_run_file
    from megatrain.hf import import_hf
    from megatrain.hf.common import return_freed_tensors

    check = _verify_requested(verify)
    try:
        return_freed_tensors()
        path = import_hf(hf_dir, out, tokenizer_file, dtype=dtype, progress=True)
        run_file = write_run_file(out)
    except ValueError as e:
        raise CommandError(str(e)) from None
    click.echo(f"megatrain import-hf: wrote {path}")
    click.echo(
        f"megatrain import-hf: wrote {run_file}, its run config: set [data] corpus there (or "
        f"pass data.corpus=DIR) and fine-tune with `megatrain run --config {run_file}` (or "
        f"`megatrain run --load {out}`)"
    )
    if check:
        from megatrain.hf.verify import cli_check

        cli_check(hf_dir, out, {**verify, "rounded": dtype}, record=True)


@main.command("convert", short_help="Cast or strip a checkpoint offline.")
@click.option(
    "--ckpt",
    required=True,
    type=click.Path(exists=True, file_okay=False),
    help="Checkpoint directory to read (the one holding `latest`).",
)
@click.option(
    "--out", required=True, type=click.Path(file_okay=False), help="Checkpoint directory to write."
)
@click.option(
    "--dtype",
    type=click.Choice(DTYPE_CHOICES),
    default="float32",
    show_default=True,
    help="dtype of the stored weights; the optimizer state stays float32.",
)
@click.option("--weights-only", is_flag=True, help="Drop the optimizer state.")
@click.option("--tp", type=click.IntRange(min=1), default=None, help="Target tensor parallelism.")
@click.option("--pp", type=click.IntRange(min=1), default=None, help="Target pipeline stages.")
def convert_command(ckpt, out, dtype, weights_only, tp, pp):
    """Rewrite the checkpoint of --ckpt under --out offline (one process, CPU), at the same
    iteration: weights cast to --dtype, optimizer state kept unless --weights-only.

    Checkpoints are layout-free (each tensor saved whole, read back in the slices any
    layout needs), so --tp/--pp move no data: they check that the model can be split so
    (heads, ffn, layers) and record the target in meta.json.  RNG files are dropped: they
    only apply at the layout that saved them.
    """
    from megatrain.checkpoint.convert import convert

    try:
        path = convert(ckpt, out, dtype, weights_only, tp, pp)
    except ValueError as e:
        raise CommandError(str(e)) from None
    click.echo(f"megatrain convert: wrote {path}")


def _plan_error(message: str) -> None:
    raise CommandError(message)


@main.command("plan", short_help="Rank the layouts of a config on a cluster before running it.")
@click.option("--config", "config_path", type=click.Path(dir_okay=False), help="A model config.")
@click.argument("overrides", nargs=-1)
@click.option("--gpus", type=click.IntRange(min=1), help="GPUs of the job.")
@click.option(
    "--gpu",
    "gpu_key",
    help="The GPU, a key of the GPU table (megatrain/plan/gpus.toml: v100-32gb, a100-80gb, "
    "h100-80gb, ...) or of --gpu-file [default: the --profile's measured device].",
)
@click.option("--gpu-file", type=click.Path(dir_okay=False), help="More [gpu.<key>] tables.")
@click.option("--nodes-of", type=click.IntRange(min=1), help="GPUs per node [the table's].")
@click.option("--global-batch", type=click.IntRange(min=1), help="[the config's]")
@click.option("--top", type=click.IntRange(min=1), default=5, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON.")
@click.option(
    "--profile",
    "profile_path",
    type=click.Path(dir_okay=False),
    help="A profile of the time model measured by --calibrate [default: the one the GPU's "
    "entry names: volta (fitted to the paper's V100 runs), ampere or hopper (published kernel "
    "figures)].",
)
@click.option(
    "--attention",
    type=click.Choice(ATTENTION_CHOICES),
    help="The attention kernel the time and memory model assume: flash (fused: O(s h) bytes, "
    "causal half skipped, no s x s scores kept) or unfused (the scores materialized, the "
    "2019 kernels) [default: the GPU table's: flash on A100 and newer, unfused on V100]; "
    "flash needs a profile with the kernel's rate (attention_tflops).",
)
@click.option("--calibrate", is_flag=True, help="Measure this machine's constants and write --out.")
@click.option("--out", type=click.Path(dir_okay=False), help="--calibrate's file.")
@click.option("--ranks", type=click.IntRange(min=1), default=2, help="--calibrate, CPU: processes.")
@click.option(
    "--fix",
    "fix",
    multiple=True,
    metavar="NAME=VALUE",
    help="Search only the splits with this value (repeatable): tp, cp, pp, cp_comm, ep or etp, "
    "e.g. --fix tp=1 --fix pp=16; the plan of a large mixture of experts searches minutes "
    "without.",
)
@click.option(
    "--workers",
    type=click.IntRange(min=1),
    default=None,
    help="Processes searching side by side, the ranking the same as one's [default: every CPU "
    "this process may use].",
)
def plan_command(
    config_path, overrides, gpus, gpu_key, gpu_file, nodes_of, global_batch, top, as_json,
    profile_path, attention, calibrate, out, ranks, fix, workers,
):  # fmt: skip
    """Rank the layouts of --config on --gpus GPUs by predicted step time.

    Every tp x cp x pp x dp = --gpus (context parallelism with its all-gather or p2p ring;
    a mixture of experts' ep x etp too) with each pipeline schedule (1F1B, ZB-H1,
    interleaved at each virtual pipeline size), micro batch, recompute mode, sequence
    parallelism and data-parallel sharding (none, the optimizer state, or FSDP, which with
    gradient accumulation is tried both reducing once a step and every microbatch) that
    `megatrain run` accepts;
    each with its memory per GPU (weights, gradients, optimizer state, activations of the
    fullest pipeline stage), its step time (compute, TP, CP and expert communication,
    pipeline bubble and point-to-point, exposed data-parallel communication, optimizer)
    and MFU; the best
    --top of those that fit 90% of the GPU's memory, and why the others were refused.
    The report names the time model's profile (--profile, else the GPU's generation in the
    GPU table), whether it was measured or comes from published figures, and how far it is
    off the published runs of that generation it was not fitted to.
    OVERRIDES are section.field=value, as for `megatrain run`.  Exit status 1 when no
    layout fits.  How far the search is goes to stderr (not with --json).

    With --calibrate, measure GEMMs by size (and float8 GEMMs on a GPU that has them),
    memory bandwidth, SDPA's causal attention by sequence length, transformer layers and
    all-reduces (over every GPU of this node, or --ranks processes on a CPU) on this machine
    and write the time model's profile to --out, for --profile; without --gpu a plan with a
    CPU's profile is for that CPU.  A config in fp8 (training.precision) is timed with its
    layers' linears in float8 and torchao's casts, compiled or not as training.compile says.
    """
    import json

    from megatrain.plan import hardware

    try:
        if calibrate:
            if not out:
                _plan_error("--calibrate needs --out FILE, where the profile goes")
            from megatrain.plan.calibrate import calibrate as measure

            profile = measure(ranks, log=lambda line: click.echo(line, err=True))
            hardware.save_profile(profile, out)
            click.echo(f"megatrain plan: wrote {out} ({profile.source})")
            return
        if not config_path:
            _plan_error("--config is required (e.g. pipelines/models/gpt2-8.3b.toml)")
        if not gpus:
            _plan_error("--gpus is required: the GPUs of the job")
        from_file = hardware.load_profile(profile_path) if profile_path else None
        gpu = hardware.job_gpu(gpus, gpu_key, gpu_file, nodes_of, from_file)
        profile = from_file or hardware.gpu_profile(gpu)
        gpu = hardware.with_attention(gpu, attention, profile)
        config = load_config(config_path, list(overrides))
        if not config.model.vocab_size:
            _plan_error(
                "model.vocab_size is 0 (the corpus's): give the tokenizer's, e.g. "
                "model.vocab_size=50257"
            )
        from megatrain.plan.published import check_rows_summary
        from megatrain.plan.report import format_plan, plan_dict
        from megatrain.plan.search import parse_fixed, plan, search_workers

        result = plan(
            config, gpus, gpu, profile, config.model.vocab_size, global_batch,
            progress=not as_json, fixed=parse_fixed(list(fix)), workers=workers or search_workers(),
        )  # fmt: skip
        check = check_rows_summary(gpu, profile)
    except (ConfigError, hardware.HardwareError, ValueError) as e:
        _plan_error(str(e))
    if as_json:
        text = json.dumps(plan_dict(result, top, check), indent=2)
    else:
        text = format_plan(result, top, check)
    click.echo(text)
    if not result.ranked:
        sys.exit(1)


if __name__ == "__main__":  # `python -m megatrain.cli`: messages still say "megatrain run: ..."
    main(prog_name="megatrain")
