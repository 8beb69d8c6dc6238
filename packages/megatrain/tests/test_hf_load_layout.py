"""`megatrain run --load-hf DIR` (checkpoint.load_hf): a run starts from a Hugging Face model's
sharded files at its own layout, each rank reading only its boxes, no checkpoint in between.

One 1-rank spawn trains the references from the HF files (a grouped-query Llama and a
Mixtral) and, for the Llama, from its import-hf checkpoint (`checkpoint.load`): the same
steps, bit for bit.  One 4-rank spawn trains the Llama at tp 2 x pp 2 and the Mixtral at
ep 2 (x dp 2) from the files: one process's steps.  The bytes each rank read are exact: its
parameters' boxes and its fp32 masters' (the same boxes again), never another rank's
slices and never the vocabulary's padding."""

import contextlib
import io
import json
import re
import shutil

import pytest
import torch
from test_hf_llama_families import random_hf
from tokenizers import Tokenizer, models, pre_tokenizers

from megacore.testing import run_distributed
from megatrain.config import ConfigError, validate
from megatrain.config.load import apply_overrides
from megatrain.hf.layout_load import hf_run_config
from megatrain.run.loop import train
from megatrain.testing import QUIET_LOGGING, assert_same_steps, write_counting_corpus

VOCAB = 200
TOL = 2e-5
RUN = [
    *QUIET_LOGGING,
    "training.seq_length=16",
    "training.micro_batch_size=2",
    "training.global_batch_size=8",
    "training.train_iters=2",
    "training.eval_interval=2",
    "training.eval_iters=1",
    "optimizer.lr=0.003",
    "optimizer.lr_warmup_iters=1",
]
HF = {  # name -> (model_type, config overrides)
    "llama": ("llama", {"num_key_value_heads": 2, "tie_word_embeddings": False}),
    "mixtral": ("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2,
                            "intermediate_size": 16}),
}  # fmt: skip
LAYOUTS = {  # name -> (model, overrides); 4 ranks
    "tp2-pp2": ("llama", ["parallel.tensor_model_parallel_size=2",
                          "parallel.pipeline_model_parallel_size=2"]),
    "ep2": ("mixtral", ["parallel.expert_model_parallel_size=2", "model.moe_grouped_gemm=false"]),
}  # fmt: skip


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """The two HF models in shards of 20 KB with a 200-token tokenizer, and a corpus whose
    manifest names that tokenizer; the Llama imported too."""
    from megatrain.hf import import_hf

    root = tmp_path_factory.mktemp("load-hf")
    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    for name, (model_type, overrides) in HF.items():
        hf = random_hf(root / "whole", model_type, vocab_size=VOCAB, **overrides)
        hf.save_pretrained(root / name, max_shard_size="20KB")
        tokenizer.save(str(root / name / "tokenizer.json"))
        shutil.rmtree(root / "whole")
    corpus = write_counting_corpus(root / "corpus", VOCAB)
    manifest = json.loads((corpus / "manifest.json").read_text())
    sha = __import__("hashlib").sha256((root / "llama" / "tokenizer.json").read_bytes())
    manifest["tokenizer"]["sha256"] = sha.hexdigest()
    (corpus / "manifest.json").write_text(json.dumps(manifest))
    import_hf(root / "llama", root / "llama-ckpt")
    return root


def _config(root, name: str, out: str, overrides=()):
    config = hf_run_config(root / name)
    apply_overrides(
        config,
        [f"data.corpus='{root}/corpus'", f"training.output_dir={out!r}", "data.verify_sha256=false",
         *RUN, *overrides],
    )  # fmt: skip
    return config


def _trained(config) -> dict | None:
    """`train`'s history with (rank 0) the per-rank bytes read it logged."""
    with contextlib.redirect_stdout(io.StringIO()) as said:
        run = train(config)
    match = re.search(r"bytes by rank \[([\d, ]+)\] of", said.getvalue())
    if run is not None and match:
        run["read"] = [int(x) for x in match.group(1).split(", ")]
    return run


def _references(root, out):
    runs = {}
    for name in HF:
        runs[name] = _trained(
            _config(root, name, f"{out}/{name}", [f"checkpoint.load_hf='{root}/{name}'"])
        )
    load = [f"checkpoint.load='{root}/llama-ckpt'"]
    runs["llama-from-import"] = _trained(_config(root, "llama", f"{out}/import", load))
    return runs


def _layouts(root, out):
    runs = {}
    for layout, (name, overrides) in LAYOUTS.items():
        load = [f"checkpoint.load_hf='{root}/{name}'", *overrides]
        runs[layout] = _trained(_config(root, name, f"{out}/{layout}", load))
    return runs


@pytest.fixture(scope="module")
def references(sources, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("one"))
    return run_distributed(_references, 1, args=(sources, out), timeout=300)[0]


@pytest.fixture(scope="module")
def layouts(sources, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("four"))
    return run_distributed(_layouts, 4, args=(sources, out), timeout=300)[0]


def _file_bytes(directory) -> dict[str, int]:
    from safetensors import safe_open

    sizes = {}
    for path in sorted(directory.glob("model*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118
                sizes[key] = f.get_slice(key).get_shape()
    return {k: 4 * torch.Size(s).numel() for k, s in sizes.items()}  # fp32 files


def test_the_files_train_as_their_import_does(references):
    a, b = references["llama"], references["llama-from-import"]
    assert a["loss"] == b["loss"] and a["grad_norm"] == b["grad_norm"] and a["valid"] == b["valid"]


def test_every_layout_reads_only_its_own_slices_and_takes_one_process_steps(
    sources, references, layouts
):
    for layout, (name, _) in LAYOUTS.items():
        assert_same_steps(layouts[layout], references[name], layout, TOL)
    # One process reads every tensor twice: into the parameters, then the fp32 masters.
    for name in HF:
        assert references[name]["read"] == [2 * sum(_file_bytes(sources / name).values())]
    # tp 2 x pp 2: each tensor is one rank's, split or whole, but the norms every TP rank holds.
    sizes = _file_bytes(sources / "llama")
    norms = sum(n for k, n in sizes.items() if "norm" in k)
    read = layouts["tp2-pp2"]["read"]
    assert sum(read) == 2 * (sum(sizes.values()) + norms)
    assert max(read) < 0.7 * sum(sizes.values())
    # ep 2: the dense weights on every rank, each expert on the ranks of its EP rank.
    sizes = _file_bytes(sources / "mixtral")
    experts = sum(n for k, n in sizes.items() if ".experts." in k)
    assert layouts["ep2"]["read"] == [2 * (sum(sizes.values()) - experts + experts // 2)] * 4


def test_load_hf_refuses_another_model_and_a_second_source(sources, tmp_path):
    from megatrain.run.preflight import check_inputs

    config = _config(sources, "llama", str(tmp_path), [f"checkpoint.load_hf='{sources}/llama'"])
    apply_overrides(config, [f"checkpoint.load='{sources}/llama-ckpt'"])
    with pytest.raises(ConfigError, match=r"checkpoint.load .* and checkpoint.load_hf"):
        validate(config)
    other = _config(sources, "llama", str(tmp_path), [f"checkpoint.load_hf='{sources}/mixtral'"])
    apply_overrides(other, ["model.num_layers=4"])
    with pytest.raises(ValueError, match=r"mixtral/config.json is a checkpoint of another model"):
        check_inputs(other)


def test_megatrain_run_load_hf_takes_the_model_from_the_files(sources, tmp_path, references):
    """`megatrain run --load-hf DIR` without --config: the model is config.json's; in workers
    of its own (2 ranks: the Llama at tp 2, the Mixtral at ep 2) it takes the one-process
    steps; no corpus named: told which override to pass."""
    import os
    import socket
    import subprocess
    import sys

    from click.testing import CliRunner

    from megatrain.cli import main

    refused = CliRunner().invoke(main, ["run", "--load-hf", str(sources / "llama")])
    assert refused.exit_code != 0 and "names no corpus: pass data.corpus=DIR" in refused.output
    # The Llama at tp 2 and the Mixtral at ep 2, each in 2 workers of its own.
    for name, layout in (("llama", LAYOUTS["tp2-pp2"][1][:1]), ("mixtral", LAYOUTS["ep2"][1])):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        out = tmp_path / name
        command = [
            sys.executable, "-m", "megatrain.cli", "run", "--load-hf", str(sources / name),
            f"data.corpus='{sources}/corpus'", "data.verify_sha256=false", *RUN, *layout,
            "--nproc-per-node", "2", "--master-port", str(port), f"training.output_dir='{out}'",
        ]  # fmt: skip
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
        result = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        assert "bytes by rank [" in result.stdout
        log = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
        losses = [r["loss"] for r in log if "loss" in r]
        assert len(losses) == len(references[name]["loss"]), (name, losses)
        for a, b in zip(losses, references[name]["loss"], strict=True):
            assert abs(a - b) < TOL, (name, losses, references[name]["loss"])
