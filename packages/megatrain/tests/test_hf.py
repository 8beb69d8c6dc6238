"""Hugging Face export/import and offline convert, checked against transformers' GPT2LMHeadModel.

One spawn of 4 gloo ranks does every step that needs process groups, in order: train a tiny GPT
at tp2 x pp2 and save; export it, import the export, convert it (bf16 with optimizer state,
fp32 weights only); then load each checkpoint at another layout for its logits or validation
loss, and fine-tune an imported random HF model through `megatrain run --load`.  The test
process compares with transformers and checks the bad inputs.
"""

import json
import math
import os
import shutil

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from tokenizers import Tokenizer

from megacore import parallel_state as ps
from megacore.testing import run_distributed
from megatrain.checkpoint.files import find_checkpoint, read_meta
from megatrain.checkpoint.load import read_full_state
from megatrain.cli import main
from megatrain.config import Config, load_config
from megatrain.run.distributed import init_distributed
from megatrain.run.loop import resume
from megatrain.run.setup import build_run
from megatrain.run.step import evaluate
from megatrain.testing import TINY_MODEL, write_text_corpus

WORDS = (  # noqa: SIM905 (a sentence reads better than a list of 25 strings)
    "the a model layer of tensor pipeline data parallel train loss token head weight "
    "gradient batch shard rank group step learning rate attention embedding vocabulary"
).split()
RUN = [
    *TINY_MODEL,
    "training.seq_length=16",
    "training.micro_batch_size=2",
    "training.global_batch_size=8",
    "training.train_iters=3",
    "training.eval_interval=3",
    "training.eval_iters=1",
    "optimizer.lr=0.01",
    "logging.log_interval=1",
    "logging.tensorboard=false",
    "logging.peak_tflops=1.0",
]
TP2_PP2 = ["parallel.tensor_model_parallel_size=2", "parallel.pipeline_model_parallel_size=2"]
TEXT = "the gradient of the attention layer, step 12: rank-group shard!"


def _texts(rng, n):
    return [" ".join(rng.choice(WORDS, rng.integers(8, 30))) + "." for _ in range(n)]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root, tok = write_text_corpus(
        tmp_path_factory.mktemp("corpus"), _texts(np.random.default_rng(0), 150)
    )
    return root, tok.get_vocab_size(with_added_tokens=True)


@pytest.fixture(scope="module")
def random_hf(corpus, tmp_path_factory):
    """A randomly initialised GPT2LMHeadModel of another shape, every weight perturbed (layer
    norms and biases too, so a swapped or misplaced tensor shows), with GPT-2 style
    vocab.json + merges.txt made from the corpus tokenizer."""
    from transformers import GPT2Config, GPT2LMHeadModel

    root, vocab = corpus
    out = tmp_path_factory.mktemp("random-hf")
    config = GPT2Config(
        vocab_size=vocab, n_positions=32, n_embd=48, n_layer=2, n_head=4, n_inner=96,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
        initializer_range=0.1,
    )  # fmt: skip
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(out)
    Tokenizer.from_file(str(root / "tokenizer.json")).model.save(str(out))  # vocab + merges
    return out


def _tokens(vocab):
    return torch.from_numpy(np.random.default_rng(5).integers(0, vocab, (2, 16)))


def _config(corpus_dir, out, *overrides):
    return load_config(
        None, [*RUN, f"data.corpus={str(corpus_dir)!r}", f"training.output_dir={out!r}", *overrides]
    )


def _loaded(config, ckpt):
    """A run of `config` loaded from `ckpt`: (iteration, adam step, valid loss, tp1 logits)."""

    device, _ = init_distributed()
    config.checkpoint.load = str(ckpt)
    run = build_run(config, device)
    try:
        resume(run)
        valid = evaluate(run)
        logits = None
        if len(run.chunks) == 1 and config.model_parallel_size == 1:
            model = run.chunks[0].module.eval()
            with torch.no_grad():
                tokens = _tokens(run.model_config.true_vocab_size)
                logits = model(tokens)[:, :, : run.model_config.true_vocab_size].transpose(0, 1)
        return run.iteration, run.optimizer.adam_step(), valid, logits
    finally:
        ps.destroy_model_parallel()


def _toml(config: dict) -> str:
    """A run config as a TOML file (None left out: TOML has no null)."""
    lines = []
    for section, values in config.items():
        if isinstance(values, dict):
            lines.append(f"[{section}]")
            for k, v in values.items():
                if v is not None:
                    lines.append(f"{k} = {json.dumps(v)}")
    return "\n".join(lines) + "\n"


def _all_steps(corpus_dir, out, imported_random):
    import torch.distributed as dist

    from megatrain import hf
    from megatrain.checkpoint import convert
    from megatrain.run.loop import train

    ckpt = f"{out}/ckpt"
    saved = train(_config(corpus_dir, f"{out}/save", *TP2_PP2, f"checkpoint.save={ckpt!r}"))
    if dist.get_rank() == 0:
        hf.export_hf(ckpt, f"{out}/hf", progress=False)
        hf.import_hf(f"{out}/hf", f"{out}/reimported")
        convert.convert(ckpt, f"{out}/bf16", "bfloat16", progress=False)
        convert.convert(ckpt, f"{out}/weights", weights_only=True, progress=False)
        convert.convert(ckpt, f"{out}/bf16-weights", "bfloat16", weights_only=True, progress=False)
    dist.barrier()
    results = {"saved": saved}
    for name in ("ckpt", "reimported"):  # at tp1 pp1 dp4: each rank holds the whole model
        results[name] = _loaded(_config(corpus_dir, f"{out}/{name}-run"), f"{out}/{name}")
    random_config = Config.from_dict(read_meta(find_checkpoint(imported_random))["config"])
    random_config.data.corpus = str(corpus_dir)
    random_config.training.output_dir = f"{out}/random-run"
    random_config.logging.tensorboard = False
    random_config.training.eval_iters = 1
    results["random"] = _loaded(random_config, imported_random)
    tp4 = ["parallel.tensor_model_parallel_size=4"]  # another vocabulary padding too
    results["weights"] = _loaded(_config(corpus_dir, f"{out}/w-run", *tp4), f"{out}/weights")
    pp2 = ["parallel.pipeline_model_parallel_size=2"]
    results["bf16"] = _loaded(_config(corpus_dir, f"{out}/b-run", *pp2), f"{out}/bf16")
    pp4 = ["parallel.pipeline_model_parallel_size=4"]
    results["bf16-weights"] = _loaded(
        _config(corpus_dir, f"{out}/bw-run", *pp4), f"{out}/bf16-weights"
    )
    # Fine-tuning the imported random model with the command line, from its meta.json config.
    config_file = f"{out}/random.toml"
    if dist.get_rank() == 0:
        with open(config_file, "w") as f:
            f.write(_toml(random_config.to_dict()))
    dist.barrier()
    main(
        ["run", "--config", config_file, "--load", str(imported_random),
         "--save", f"{out}/finetuned", "parallel.tensor_model_parallel_size=2",
         "training.seq_length=16", "training.micro_batch_size=2", "training.global_batch_size=8",
         "training.train_iters=2", "training.eval_interval=2", "training.eval_iters=1",
         f"training.output_dir={out + '/finetune-run'!r}", "logging.peak_tflops=1.0",
         "logging.log_interval=1"],
        standalone_mode=False,
    )  # fmt: skip
    return results


@pytest.fixture(scope="module")
def steps(corpus, random_hf, tmp_path_factory):
    from megatrain.hf import import_hf

    root, _ = corpus
    out = tmp_path_factory.mktemp("steps")
    # The corpus's own tokenizer.json, so fine-tuning on that corpus passes the sha256 check.
    import_hf(random_hf, out / "random", tokenizer_file=root / "tokenizer.json")
    results = run_distributed(
        _all_steps, 4, args=(str(root), str(out), str(out / "random")), timeout=400
    )[0]
    return out, results


def _hf_logits(hf_dir, vocab):
    from transformers import GPT2LMHeadModel

    model = GPT2LMHeadModel.from_pretrained(hf_dir).eval()
    with torch.no_grad():
        return model(_tokens(vocab)).logits


def test_export_loads_in_transformers_with_our_logits(steps, corpus):
    out, results = steps
    _, vocab = corpus
    config = json.loads((out / "hf" / "config.json").read_text())
    assert (config["n_layer"], config["n_embd"], config["n_head"]) == (4, 32, 4)
    assert (config["vocab_size"], config["n_positions"], config["n_inner"]) == (vocab, 32, 128)
    assert config["activation_function"] == "gelu_new" and config["tie_word_embeddings"]
    ours = results["ckpt"][3]
    theirs = _hf_logits(out / "hf", vocab)
    assert ours.shape == theirs.shape == (2, 16, vocab)
    assert (ours - theirs).abs().max() < 1e-4
    assert ours.std() > 0.1  # trained logits, not a flat distribution
    # Readable as the user's other files (safetensors alone writes 0600).
    umask = os.umask(0)
    os.umask(umask)
    assert (out / "hf" / "model.safetensors").stat().st_mode & 0o777 == 0o666 & ~umask


def test_export_tokenizer_encodes_as_the_checkpoint(steps, corpus):
    from transformers import AutoTokenizer

    out, _ = steps
    root, _ = corpus
    ours = Tokenizer.from_file(str(find_checkpoint(out / "ckpt") / "tokenizer.json"))
    theirs = AutoTokenizer.from_pretrained(out / "hf")
    ids = ours.encode(TEXT).ids
    assert len(ids) > 10 and theirs.encode(TEXT) == ids
    assert theirs.eos_token_id == theirs.bos_token_id == 0  # the corpus's end of document
    assert (out / "hf" / "tokenizer.json").read_bytes() == (root / "tokenizer.json").read_bytes()
    generation = json.loads((out / "hf" / "generation_config.json").read_text())
    assert generation["eos_token_id"] == 0


def test_import_of_the_export_is_the_same_model(steps, corpus):
    out, results = steps
    root, vocab = corpus
    iteration, adam_step, valid, logits = results["reimported"]
    assert (iteration, adam_step) == (0, 0)  # weights only: training would start here
    assert (logits - _hf_logits(out / "hf", vocab)).abs().max() < 1e-4
    assert abs(valid - results["ckpt"][2]) < 1e-5
    meta = read_meta(find_checkpoint(out / "reimported"))
    manifest = json.loads((root / "manifest.json").read_text())
    assert meta["tokenizer"]["sha256"] == manifest["tokenizer"]["sha256"]  # byte for byte
    assert meta["optimizer"] is None and not (find_checkpoint(out / "reimported") / "rng").exists()


def test_import_of_a_random_hf_model_gives_its_logits(steps, random_hf, corpus):
    _, results = steps
    _, vocab = corpus
    logits = results["random"][3]
    theirs = _hf_logits(random_hf, vocab)
    assert logits.shape == theirs.shape
    assert (logits - theirs).abs().max() < 1e-4
    assert theirs.std() > 0.5  # large random weights: a real test of every tensor's place


def test_megatrain_run_fine_tunes_an_imported_model(steps):
    out, _ = steps
    records = [json.loads(line) for line in (out / "finetune-run" / "log.jsonl").open()]
    losses = [r["loss"] for r in records if "loss" in r]
    assert [r["iteration"] for r in records if "loss" in r] == [1, 2]  # counted from 0
    assert all(math.isfinite(x) for x in losses)
    meta = read_meta(find_checkpoint(out / "finetuned"))
    assert meta["iteration"] == 2 and meta["optimizer"]["adam_step"] == 2


def test_converted_checkpoints_load_at_other_layouts(steps):
    _, results = steps
    saved_valid = results["saved"]["valid"][-1]
    assert saved_valid[0] == 3
    # Plain tensors written in one process, read in the slices of another layout.
    iteration, adam_step, valid, _ = results["weights"]  # fp32, weights only, at tp4
    assert (iteration, adam_step) == (0, 0)
    assert abs(valid - saved_valid[1]) < 2e-5
    iteration, adam_step, valid, _ = results["bf16-weights"]  # at pp4
    assert (iteration, adam_step) == (0, 0)
    assert valid != saved_valid[1] and abs(valid - saved_valid[1]) < 2e-2  # rounded weights
    # bf16 weights with the fp32 optimizer state: an fp32 run takes its weights from the fp32
    # masters, so it resumes (at pp2) exactly where the saving run stopped.
    iteration, adam_step, valid, _ = results["bf16"]
    assert (iteration, adam_step) == (3, 3)
    assert abs(valid - saved_valid[1]) < 2e-5


def test_convert_writes_dtype_layout_and_drops_rng(steps, tmp_path):
    out, _ = steps
    meta, weights = read_full_state(out / "ckpt", with_optimizer=True, progress=False)
    bf16_meta, bf16 = read_full_state(out / "bf16", with_optimizer=True, progress=False)
    assert bf16_meta["dtype"] == "bfloat16" and bf16_meta["iteration"] == meta["iteration"] == 3
    assert bf16.keys() == weights.keys()
    for name, t in weights.items():
        if "/" in name:  # optimizer state stays fp32, unchanged
            assert bf16[name].dtype == torch.float32 and torch.equal(bf16[name], t), name
        else:
            assert bf16[name].dtype == torch.bfloat16, name
            assert torch.equal(bf16[name], t.to(torch.bfloat16)), name
    assert not (find_checkpoint(out / "bf16") / "rng").exists()
    assert (find_checkpoint(out / "ckpt") / "rng").is_dir()
    weights_meta, only = read_full_state(out / "weights", progress=False)
    assert weights_meta["optimizer"] is None
    assert all(torch.equal(only[n], weights[n]) for n in only) and len(only) == 4 * 12 + 4

    result = CliRunner().invoke(
        main,
        ["convert", "--ckpt", str(out / "ckpt"), "--out", str(tmp_path / "tp4"), "--tp", "4",
         "--pp", "2", "--weights-only"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    layout = read_meta(find_checkpoint(tmp_path / "tp4"))["layout"]
    assert (layout["tensor_model_parallel_size"], layout["pipeline_model_parallel_size"]) == (4, 2)
    again = CliRunner().invoke(
        main, ["convert", "--ckpt", str(out / "ckpt"), "--out", str(tmp_path / "tp4")]
    )
    assert again.exit_code == 2 and "iter_0000003 already exists" in again.output


def test_import_reads_vocab_merges_and_pytorch_bin(random_hf, corpus, tmp_path):
    from megatrain.hf import import_hf

    root, _ = corpus
    import_hf(random_hf, tmp_path / "ckpt")  # vocab.json + merges.txt
    directory = find_checkpoint(tmp_path / "ckpt")
    ours = Tokenizer.from_file(str(directory / "tokenizer.json"))
    assert (
        ours.encode(TEXT).ids == Tokenizer.from_file(str(root / "tokenizer.json")).encode(TEXT).ids
    )
    _, from_safetensors = read_full_state(tmp_path / "ckpt", progress=False)

    from safetensors.torch import load_file

    bin_dir = tmp_path / "bin"
    shutil.copytree(random_hf, bin_dir)
    state = load_file(str(bin_dir / "model.safetensors"))
    (bin_dir / "model.safetensors").unlink()
    # As OpenAI's GPT-2 files: no "transformer." prefix, causal-mask buffers among the weights.
    old_style = {n.removeprefix("transformer."): t for n, t in state.items()}
    old_style |= {f"h.{i}.attn.bias": torch.ones(1, 1, 32, 32).tril() for i in range(2)}
    torch.save(old_style, bin_dir / "pytorch_model.bin")
    import_hf(bin_dir, tmp_path / "from-bin")
    _, from_bin = read_full_state(tmp_path / "from-bin", progress=False)
    assert from_bin.keys() == from_safetensors.keys()
    assert all(torch.equal(from_bin[n], from_safetensors[n]) for n in from_bin)


def _invoke(*args):
    return CliRunner().invoke(main, list(args))


def test_bad_input_is_refused_with_the_path(steps, random_hf, tmp_path):
    out, _ = steps
    result = _invoke("export-hf", "--ckpt", str(tmp_path / "nowhere"), "--out", str(tmp_path / "x"))
    assert (
        result.exit_code == 2 and "nowhere" in result.output and "does not exist" in result.output
    )
    (tmp_path / "empty").mkdir()
    result = _invoke("export-hf", "--ckpt", str(tmp_path / "empty"), "--out", str(tmp_path / "x"))
    assert result.exit_code == 2 and "empty/latest does not exist" in result.output
    no_tokenizer = tmp_path / "no-tokenizer"
    shutil.copytree(out / "ckpt", no_tokenizer)
    directory = find_checkpoint(no_tokenizer)  # as saved from a corpus without tokenizer.json
    (directory / "tokenizer.json").unlink()
    meta = json.loads((directory / "meta.json").read_text())
    del meta["files"]["tokenizer.json"]
    (directory / "meta.json").write_text(json.dumps(meta))
    result = _invoke("export-hf", "--ckpt", str(no_tokenizer), "--out", str(tmp_path / "x"))
    assert result.exit_code == 2 and "tokenizer.json does not exist" in result.output

    for field, value, message in (
        # Refused naming every model_type import reads (test_hf_export_resolved.py lists them).
        ("model_type", "gpt_neox", "model_type is 'gpt_neox'; megatrain import-hf reads gpt2,"),
        # Read as a Llama now (test_llama.py), a GPT-2 config.json lacks its fields.
        ("model_type", "llama", "no integer num_hidden_layers, hidden_size"),
        ("activation_function", "relu", "activation_function is 'relu'"),
        ("tie_word_embeddings", False, "tie_word_embeddings is False"),
        ("scale_attn_by_inverse_layer_idx", True, "scale_attn_by_inverse_layer_idx is True"),
        ("reorder_and_upcast_attn", True, "reorder_and_upcast_attn is True"),
        ("add_cross_attention", True, "add_cross_attention is True"),
    ):
        bad = tmp_path / f"bad-{field}-{value}"
        shutil.copytree(random_hf, bad)
        config = json.loads((bad / "config.json").read_text())
        (bad / "config.json").write_text(json.dumps({**config, field: value}))
        result = _invoke("import-hf", str(bad), "--out", str(tmp_path / "y"))
        assert result.exit_code == 2 and message in result.output, (field, result.output)
        assert "config.json" in result.output
    no_tok = tmp_path / "hf-no-tokenizer"
    shutil.copytree(random_hf, no_tok)
    (no_tok / "vocab.json").unlink()
    result = _invoke("import-hf", str(no_tok), "--out", str(tmp_path / "y"))
    assert result.exit_code == 2 and "no tokenizer" in result.output
    result = _invoke("import-hf", str(tmp_path / "empty"), "--out", str(tmp_path / "y"))
    assert result.exit_code == 2 and "config.json does not exist" in result.output
    assert not (tmp_path / "y").exists()

    # (--pp 3 over the 4 layers is a split, 2, 1 and 1: forward passes' uneven stages)
    for flag, value, message in (
        ("--tp", "3", "num_attention_heads (4) is not divisible by parallel.tensor_model_parallel"),
        ("--pp", "5", "the model has 4 transformer layers, fewer than the pipeline stages"),
    ):
        result = _invoke("convert", "--ckpt", str(out / "ckpt"), "--out", str(tmp_path / "z"),
                         flag, value)  # fmt: skip
        assert result.exit_code == 2 and message in result.output, result.output
        assert f"cannot be split to --tp {3 if flag == '--tp' else 2}" in result.output
    result = _invoke("convert", "--ckpt", str(out / "ckpt"), "--out", str(out / "ckpt"))
    assert result.exit_code == 2 and "is the input checkpoint" in result.output
    assert not (tmp_path / "z").exists()
