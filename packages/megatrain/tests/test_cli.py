"""`megatrain run`: bad configs refused before any worker starts; real runs under our launcher
(torch's elastic agent) and under torchrun, with the log line, log.jsonl, TensorBoard and plot."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from megatrain.cli import main
from megatrain.run import launch
from megatrain.testing import random_documents, write_corpus

ROOT = Path(__file__).resolve().parents[3]
TINY = ROOT / "pipelines" / "models" / "gpt2-tiny.toml"
VOCAB = 200


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    rng = np.random.default_rng(1)

    def docs(n):
        return random_documents(rng, n, VOCAB, 40, 120)

    root = tmp_path_factory.mktemp("corpus")
    return write_corpus(
        root, {"train": [docs(40), docs(40)], "valid": [docs(20)]}, vocab_size=VOCAB
    )


def test_help_and_unknown_command():
    result = CliRunner().invoke(main, ["-h"])
    assert result.exit_code == 0 and "pipeline and data parallelism" in result.output
    assert CliRunner().invoke(main, ["no-such-command"]).exit_code == 2
    result = CliRunner().invoke(main, ["run", "-h"])
    assert result.exit_code == 0 and "--nnodes" in result.output and "OVERRIDES" in result.output


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["parallel.tensor_model_parallel_size=8"],
            "model.num_attention_heads (4) is not divisible by "
            "parallel.tensor_model_parallel_size (8)",
        ),
        (
            [
                "parallel.pipeline_model_parallel_size=2",
                "parallel.virtual_pipeline_model_parallel_size=4",
            ],
            "model.num_layers (4) is not divisible by parallel.pipeline_model_parallel_size x "
            "virtual_pipeline_model_parallel_size (2 x 4 = 8)",
        ),
        (
            ["parallel.data_parallel_size=3"],
            "training.global_batch_size (16) is not divisible by training.micro_batch_size x "
            "data-parallel size (8 x 3 = 24)",
        ),
        (
            ["training.seq_length=512"],
            "training.seq_length (512) is above model.max_position_embeddings (256)",
        ),
        (
            [
                "parallel.pipeline_model_parallel_size=2",
                "parallel.pipeline_model_parallel_layout=Et*3|ttL",
            ],
            "parallel.pipeline_model_parallel_layout holds 5 transformer layers (t); "
            "model.num_layers is 4",
        ),
        (["model.num_heads=4"], "unknown field model.num_heads"),
        (["trainig.train_iters=4"], "unknown section [trainig]"),
        (["training.train_iters=lots"], "training.train_iters: expected int, got 'lots'"),
        (['training.precision="fp4"'], "expected one of fp32, bf16, fp16, fp8, got 'fp4'"),
        (["training.train_iters"], "expected section.field=value"),
        (["model.vocab_size=50257"], "vocab_size"),
        (["data.corpus=/no/such/corpus"], "/no/such/corpus/manifest.json"),
        (["checkpoint.load=/no/such/ckpt"], "/no/such/ckpt/latest does not exist"),
        (['model.kind="t5"'], "model.kind must be one of ('gpt', 'bert', 'llama'), got 't5'"),
        (['model.block_order="post_ln"'], "is BERT's original order (Fig. 7 a); GPT-2 is pre_ln"),
        # A GPT corpus given to a BERT config: refused by the manifest's tokenizer kind.
        (['model.kind="bert"'], "tokenizer.kind is 'gpt2-bpe', expected 'bert-wordpiece'"),
        (
            [
                "parallel.sequence_parallel=true",
                "parallel.distribute_saved_activations=true",
                "parallel.tensor_model_parallel_size=2",
            ],
            "turn one of them off",
        ),
    ],
)
def test_bad_config_is_refused_before_workers_start(corpus, monkeypatch, overrides, message):
    def no_launch(*args, **kwargs):
        raise AssertionError("workers were started for a config that cannot run")

    monkeypatch.setattr(launch, "launch", no_launch)
    args = ["run", "--config", str(TINY), f"data.corpus={str(corpus)!r}", *overrides]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2, result.output
    assert message in result.output, result.output


def test_cuda_graphs_without_a_gpu_are_refused_before_workers_start(corpus, monkeypatch):
    import torch

    monkeypatch.setattr(launch, "launch", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    args = ["run", "--config", str(TINY), f'data.corpus="{corpus}"', "training.cuda_graphs=true"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2, result.output
    assert "training.cuda_graphs = true needs a CUDA device; this run is on cpu" in result.output


def test_unknown_key_in_config_file(tmp_path, monkeypatch):
    monkeypatch.setattr(launch, "launch", None)
    bad = tmp_path / "bad.toml"
    bad.write_text(TINY.read_text().replace("[training]", "[training]\nbatch = 8"))
    result = CliRunner().invoke(main, ["run", "--config", str(bad)])
    assert result.exit_code == 2 and f"{bad}: unknown field training.batch" in result.output


def test_more_ranks_than_gpus_is_refused_before_workers_start(corpus, monkeypatch):
    """NCCL refuses two ranks on one GPU only once every worker runs (seen on an H100)."""
    import torch

    monkeypatch.setattr(launch, "launch", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    args = ["run", "--config", str(TINY), f'data.corpus="{corpus}"', "--nproc-per-node", "2"]
    result = CliRunner().invoke(main, [*args, "parallel.pipeline_model_parallel_size=2"])
    assert result.exit_code == 2, result.output
    assert "--nproc-per-node 2 exceeds the 1 GPU(s)" in result.output


def test_slurm_environment_is_adopted(monkeypatch):
    # adopt_slurm_environment writes RANK, WORLD_SIZE, ... into os.environ: a copy here, so
    # that no later test in this process finds itself "in a launched job".
    monkeypatch.setattr(os, "environ", os.environ.copy())
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("SLURM_PROCID", "9")
    monkeypatch.setenv("SLURM_NTASKS", "16")
    monkeypatch.setenv("SLURM_LOCALID", "1")
    with pytest.raises(launch.LaunchError, match="MASTER_ADDR is not set"):
        launch.adopt_slurm_environment()
    monkeypatch.setenv("MASTER_ADDR", "node001")
    assert launch.adopt_slurm_environment()
    assert (os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["LOCAL_RANK"]) == (
        "9",
        "16",
        "1",
    )
    assert launch.in_launched_job() and not launch.adopt_slurm_environment()


def _run(command, out):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


def _common(corpus, out):
    return [
        "--config", str(TINY),
        f"data.corpus={str(corpus)!r}", f"training.output_dir={str(out)!r}",
        "training.train_iters=6", "training.eval_interval=3", "training.eval_iters=1",
        "logging.log_interval=2", "training.seq_length=32", "optimizer.lr_warmup_iters=2",
    ]  # fmt: skip


def _check_outputs(stdout, out, ranks):
    lines = [line for line in stdout.splitlines() if line.startswith("iteration ")]
    assert [line.split(" |")[0] for line in lines] == [f"iteration {i}/6" for i in (2, 3, 4, 6)]
    for field in ("loss ", "lr ", "grad norm ", "loss scale ", "skipped ", "tokens/s",
                  "TFLOP/s/device", "MFU ", "elapsed ", "ETA "):  # fmt: skip
        assert field in lines[0], lines[0]
    assert "elapsed " in lines[-1] and "ETA" not in lines[-1]  # done: no time left to show
    assert "valid loss" in lines[1] and f"{ranks} ranks" in stdout
    records = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records] == [2, 3, 4, 6]
    assert records[-1]["valid_loss"] > 0 and records[-1]["mfu"] > 0
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))
    assert json.loads((out / "config.json").read_text())["training"]["train_iters"] == 6


def test_run_starts_its_own_workers(corpus, tmp_path):
    """No launcher: torch's elastic agent starts tp x pp x dp = 2 workers."""
    out = tmp_path / "run"
    command = [sys.executable, "-m", "megatrain.cli", "run", *_common(corpus, out),
               "parallel.tensor_model_parallel_size=2", "--save", str(out / "ckpt")]  # fmt: skip
    _check_outputs(_run(command, out), out, ranks=2)
    assert (out / "ckpt" / "latest").read_text().strip() == "iter_0000006"
    # Again, resuming from its own checkpoint: finished, known before any worker starts.
    events = sorted((out / "tensorboard").iterdir())
    again = _run([*command, "--load", str(out / "ckpt")], out)
    assert again.strip() == (
        f"megatrain run: nothing to do: {out / 'ckpt'} already holds iteration 6 of "
        "training.train_iters=6 (raise training.train_iters to train on, or --save/--load "
        "elsewhere to start over)"
    )
    assert sorted((out / "tensorboard").iterdir()) == events  # no empty event file


def test_run_joins_torchrun(corpus, tmp_path):
    """Under torchrun each process joins the job from the environment (here dp=2)."""
    out = tmp_path / "torchrun"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
               "2", "-m", "megatrain.cli", "run", *_common(corpus, out)]  # fmt: skip
    _check_outputs(_run(command, out), out, ranks=2)


def _shipped_steps(corpus, out, name, overrides, extra=()):
    """`megatrain run` of the shipped config `name` for 3 steps with `overrides`: (what it
    said, each step's loss, gradient norm and validation loss from log.jsonl)."""
    config = ROOT / "pipelines" / "models" / f"{name}.toml"
    command = [sys.executable, "-m", "megatrain.cli", "run", "--config", str(config),
               f"data.corpus={str(corpus)!r}", f"training.output_dir={str(out)!r}",
               "training.train_iters=3", "training.eval_interval=3", "training.eval_iters=1",
               "logging.log_interval=1", "logging.tensorboard=false",
               "training.seq_length=32", "optimizer.lr_warmup_iters=1", *extra,
               *overrides]  # fmt: skip
    said = _run(command, out)
    records = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    return said, [(r["loss"], r["grad_norm"], r.get("valid_loss")) for r in records]


def _same_steps(steps, reference):
    assert len(reference) == 3 and reference[-1][2] is not None
    for (loss, norm, valid), (ref_loss, ref_norm, ref_valid) in zip(steps, reference, strict=True):
        assert abs(loss - ref_loss) < 2e-5 and abs(norm - ref_norm) < 2e-5 * ref_norm, steps
        assert (valid is None) == (ref_valid is None)
        assert valid is None or abs(valid - ref_valid) < 2e-5


def _layout_takes_the_one_process_steps(corpus, tmp_path, name, layout, said_ranks, extra=()):
    """`megatrain run` of a shipped config alone and at `layout` (overrides) take the same
    steps: losses, gradient norms and validation losses from log.jsonl."""
    _, reference = _shipped_steps(corpus, tmp_path / "one", name, [], extra)
    said, steps = _shipped_steps(corpus, tmp_path / "layout", name, layout, extra)
    assert said_ranks in said
    _same_steps(steps, reference)


def test_llama_tiny_at_cp2_takes_the_one_process_steps(corpus, tmp_path):
    """`megatrain run` of the shipped llama-tiny with each sequence split over 2 CP workers."""
    _layout_takes_the_one_process_steps(
        corpus, tmp_path, "llama-tiny", ["parallel.context_parallel_size=2"],
        "2 ranks = tp 1 x cp 2 x pp 1 x dp 1",
    )  # fmt: skip


def test_mixtral_tiny_at_ep2_takes_the_one_process_steps(corpus, tmp_path):
    """`megatrain run` of the shipped mixtral-tiny with its 8 experts over 2 expert-parallel
    workers (4 each, tokens dispatched by all-to-all); a smaller batch and no grouped GEMM
    to keep it quick on a CPU."""
    _layout_takes_the_one_process_steps(
        corpus, tmp_path, "mixtral-tiny", ["parallel.expert_model_parallel_size=2"],
        "2 ranks = tp 1 x pp 1 x dp 2 (experts: etp 1 x ep 2 x edp 1)",
        ["training.micro_batch_size=2", "training.global_batch_size=4",
         "model.moe_grouped_gemm=false"],
    )  # fmt: skip


# The shipped configs' layouts through `megatrain run` (2 ranks each) and how it names each.
CLI_LAYOUTS = {
    "tp2-sp": (
        ["parallel.tensor_model_parallel_size=2", "parallel.sequence_parallel=true"],
        "2 ranks = tp 2 x pp 1 x dp 1",
    ),
    "cp2-p2p": (
        ["parallel.context_parallel_size=2", "parallel.cp_comm_type='p2p'"],
        "2 ranks = tp 1 x cp 2 x pp 1 x dp 1",
    ),
    "cp2-allgather": (
        ["parallel.context_parallel_size=2", "parallel.cp_comm_type='allgather'"],
        "2 ranks = tp 1 x cp 2 x pp 1 x dp 1",
    ),
    "cp2-latent": (  # multi-latent attention's own: the latent gathered, K/V up-projected
        ["parallel.context_parallel_size=2", "parallel.cp_comm_type='latent'"],
        "2 ranks = tp 1 x cp 2 x pp 1 x dp 1",
    ),
    "ep2": (
        ["parallel.expert_model_parallel_size=2"],
        "2 ranks = tp 1 x pp 1 x dp 2 (experts: etp 1 x ep 2 x edp 1)",
    ),
    "pp2": (["parallel.pipeline_model_parallel_size=2"], "2 ranks = tp 1 x pp 2 x dp 1"),
    # deepseek-tiny's 4 layers as 3 + 1, the MTP depth on the last stage; the override as a
    # shell hands it on from parallel.pipeline_model_parallel_layout="Et*3|tmL".
    "pp2-uneven": (
        [
            "parallel.pipeline_model_parallel_size=2",
            "parallel.pipeline_model_parallel_layout=Et*3|tmL",
        ],
        "each pipeline stage (virtual stages in model order, "
        "parallel.pipeline_model_parallel_layout): 3, 1",
    ),
}
GPT_OSS_LAYOUTS = {k: CLI_LAYOUTS[k] for k in ("tp2-sp", "cp2-p2p", "cp2-allgather", "ep2", "pp2")}


# Six `megatrain run`s, each starting its workers (46 s in a quiet CI run).
@pytest.mark.timeout(900)
def test_gpt_oss_tiny_takes_the_one_process_steps_at_each_layout(corpus, tmp_path):
    """`megatrain run` of the shipped gpt-oss-tiny (sinks, layers alternating a window of 16
    keys, shorter than the 32-token sequence, with full attention, biased clamped experts,
    YaRN) at tp 2 + sp, cp 2 over the p2p ring and over the all-gather, ep 2 and pp 2 takes
    the one-process steps (run once, first); mixtral-tiny's smaller batch and no grouped
    GEMM, to keep it quick on a CPU."""
    from megatrain.config import load_config

    model = load_config(ROOT / "pipelines" / "models" / "gpt-oss-tiny.toml").model
    assert model.window_size < 32 and model.softmax_type == "learnable"
    assert "full_attention" in model.layer_types and "sliding_attention" in model.layer_types
    extra = ["training.micro_batch_size=2", "training.global_batch_size=4",
             "model.moe_grouped_gemm=false"]  # fmt: skip
    _, reference = _shipped_steps(corpus, tmp_path / "one", "gpt-oss-tiny", [], extra)
    for name, (layout, said_ranks) in GPT_OSS_LAYOUTS.items():
        said, steps = _shipped_steps(corpus, tmp_path / name, "gpt-oss-tiny", layout, extra)
        assert said_ranks in said, (name, said[:300])
        _same_steps(steps, reference)


# deepseek-tiny's (--nproc-per-node 2), the latent gather among them.
DEEPSEEK_LAYOUTS = {
    k: CLI_LAYOUTS[k] for k in ("tp2-sp", "cp2-p2p", "cp2-latent", "pp2", "pp2-uneven", "ep2")
}
MTP_FIELDS = ("mtp_loss/depth1", "valid_mtp_loss/depth1")


def _mtp_losses(out) -> list[tuple]:
    """Each step's MTP depth loss and validation depth loss (None off the eval step)."""
    records = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    return [tuple(r.get(f) for f in MTP_FIELDS) for r in records]


@pytest.mark.timeout(900)
def test_deepseek_tiny_takes_the_one_process_steps_at_each_layout(corpus, tmp_path):
    """`megatrain run` of the shipped deepseek-tiny (multi-latent attention, a dense first
    layer, sigmoid experts with the expert bias in group-limited routing, a shared expert,
    one MTP depth) at tp 2 + sp, cp 2 over the p2p ring and by the latent gather, pp 2 and
    ep 2 (`--nproc-per-node 2`) takes the one-process steps, run once, first: losses,
    gradient norms, validation loss and the MTP depth's training and validation losses from
    log.jsonl.  Kept cheap: 3 steps at seq 32, a batch of 4 in microbatches of 2, one
    validation batch, the experts' loop instead of torch's CPU grouped GEMM."""
    from megatrain.config import load_config

    model = load_config(ROOT / "pipelines" / "models" / "deepseek-tiny.toml").model
    assert model.multi_latent_attention and model.mtp_num_layers == 1
    assert model.moe_router_num_groups == 4 and model.moe_router_group_topk == 2
    extra = ["training.micro_batch_size=2", "training.global_batch_size=4",
             "model.moe_grouped_gemm=false", "--nproc-per-node", "1"]  # fmt: skip
    _, reference = _shipped_steps(corpus, tmp_path / "one", "deepseek-tiny", [], extra)
    reference_mtp = _mtp_losses(tmp_path / "one")
    assert all(m is not None for m, _ in reference_mtp) and reference_mtp[-1][1] is not None
    extra[-1] = "2"
    for name, (layout, said_ranks) in DEEPSEEK_LAYOUTS.items():
        said, steps = _shipped_steps(corpus, tmp_path / name, "deepseek-tiny", layout, extra)
        assert said_ranks in said, (name, said[:300])
        _same_steps(steps, reference)
        for got, want in zip(_mtp_losses(tmp_path / name), reference_mtp, strict=True):
            assert (got[1] is None) == (want[1] is None), (name, got, want)
            for a, b in zip(got, want, strict=True):
                assert b is None or abs(a - b) < 2e-5, (name, got, want)
