"""The parity report (`megatrain import-hf --verify`, `export-hf --verify`, `hf/verify.py`):
on tiny random HF models made here (every weight perturbed), a faithful import passes with
numbers near zero and top-1 agreement 1, is written into meta.json's `imported_from` with
the checkpoint still whole; a checkpoint with one layer's weight perturbed fails (exit 1)
naming that layer; layer by layer (forced by a budget of one byte) gives the whole model's
numbers exactly, for Llama, two MoE families and GPT-2 (tied, learned positions), while
holding one module's weights at a time; an export checks against its checkpoint."""

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from test_hf_llama_families import MODELS, VOCAB, random_hf
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from megatrain.checkpoint.convert import write_checkpoint
from megatrain.checkpoint.files import find_checkpoint, read_meta
from megatrain.checkpoint.load import read_full_state
from megatrain.cli import main
from megatrain.hf import export_hf, import_hf, layerwise
from megatrain.hf.verify import DEFAULT_TEXT, TOLERANCES, _compare, format_report, verify

# 300 words of the tiny models' WordLevel vocabulary (t0 .. t95), not one token repeated.
TEXT = " ".join(f"t{(7 * i * i + 3 * i + 1) % VOCAB}" for i in range(300))
METRICS = ("max_abs_logit_diff", "mean_abs_logit", "kl_mean", "kl_max", "top1_agreement",
           "layer_max_abs_diff", "layer_max_abs", "first_layer_off", "worst_layer")  # fmt: skip
PERTURBED = "layers.1.mlp.fc2.weight"


def _invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A 3-layer random HF Llama of 256 positions (weights of std ~0.5, activations ~100: any
    error is amplified) and the text file."""
    root = tmp_path_factory.mktemp("verify")
    random_hf(root / "hf", "llama", num_hidden_layers=3, max_position_embeddings=256)
    (root / "text.txt").write_text(TEXT)
    return root


def _same(a: dict, b: dict) -> None:
    assert {k: a[k] for k in METRICS} == {k: b[k] for k in METRICS}


def test_a_faithful_import_passes_and_the_report_goes_into_meta_json(llama):
    out = llama / "ckpt"
    result = _invoke(
        "import-hf", llama / "hf", "--out", out, "--verify", "--verify-text", llama / "text.txt"
    )
    assert result.exit_code == 0, result.output
    for line in ("max |Δ logit|", "KL(HF || ours)", "top-1 agreement  1.0000", "worst layer",
                 "first layer off  none", "PASSED"):  # fmt: skip
        assert line in result.output, result.output
    directory = find_checkpoint(out)  # meta.json rewritten: the file list still checks
    imported = read_meta(directory)["imported_from"]
    assert imported["model_type"] == "llama"  # what the import wrote stays
    r = imported["verify"]
    assert r["passed"] and r["mode"] == "whole model" and r["dtype"] == "float32"
    assert r["tokens"] == 256 and r["text"] == str(llama / "text.txt")
    assert r["max_abs_logit_diff"] < 1e-4 < r["mean_abs_logit"]  # not a zero model
    assert r["kl_max"] < 1e-9 and r["top1_agreement"] == 1.0
    assert len(r["layer_max_abs_diff"]) == 3 and r["first_layer_off"] is None
    assert all(
        d < 1e-5 * h for d, h in zip(r["layer_max_abs_diff"], r["layer_max_abs"], strict=True)
    )


def test_layer_by_layer_holds_one_module_and_equals_the_whole_model(llama, monkeypatch):
    ckpt = llama / "ckpt-lib"
    import_hf(llama / "hf", ckpt)
    whole = verify(llama / "hf", ckpt, text=TEXT, layer_by_layer=False)
    held, groups = [], []
    streamed = layerwise._streamed

    def spy(model, layers, read):  # before each module loads, nothing else holds weights
        def counted(name, module):
            groups.append(name)
            held.append(sum(p.numel() for p in model.parameters() if not p.is_meta))
            return read(name, module)

        return streamed(model, layers, counted)

    monkeypatch.setattr(layerwise, "_streamed", spy)
    budget = verify(llama / "hf", ckpt, text=TEXT, memory_budget=1)  # the whole cannot fit
    assert budget["mode"] == "layer by layer" and budget["memory"]["budget_bytes"] == 1
    _same(budget, whole)
    hf_groups = ["model.embed_tokens", *(f"model.layers.{i}" for i in range(3)), "model.norm",
                 "lm_head"]  # fmt: skip
    ours = ["embedding", *(f"layers.{i}" for i in range(3)), "final_layernorm", "output_layer"]
    assert groups == hf_groups + ours and held == [0] * len(groups)


def test_a_perturbed_weight_fails_naming_its_layer(llama, monkeypatch):
    import megatrain.hf as hf

    real = hf.import_hf

    def perturbed_import(hf_dir, out, *args, **kwargs):  # an importer bug in layer 1
        faithful = real(hf_dir, Path(out).parent / "faithful", *args, **kwargs)
        meta, state = read_full_state(faithful.parent, progress=False)
        noise = torch.randn(state[PERTURBED].shape, generator=torch.Generator().manual_seed(0))
        state[PERTURBED] += 0.5 * noise
        meta = {k: v for k, v in meta.items() if k not in ("files", "format_version")}
        tokenizer = (faithful / "tokenizer.json").read_bytes()
        return write_checkpoint(out, meta, state, None, tokenizer)

    monkeypatch.setattr(hf, "import_hf", perturbed_import)
    out = llama / "bad" / "ckpt"
    result = _invoke(
        "import-hf", llama / "hf", "--out", out, "--verify", "--verify-text", llama / "text.txt"
    )
    assert result.exit_code == 1, result.output
    assert "first layer off  1: max |Δ hidden|" in result.output  # the report, printed
    assert "--verify failed: max |Δ logit|" in result.output
    assert "first layer off: 1 (the report is in meta.json" in result.output
    r = read_meta(find_checkpoint(out))["imported_from"]["verify"]
    assert not r["passed"] and r["first_layer_off"] == 1 and r["max_abs_logit_diff"] > 0.01
    assert r["layer_max_abs_diff"][0] < 1e-4 < r["layer_max_abs_diff"][1]
    assert r["top1_agreement"] < 1.0 and r["kl_mean"] > 1e-4
    _same(verify(llama / "hf", out, text=TEXT, layer_by_layer=True), r)


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe", "deepseek_v3"])
def test_moe_families_layer_by_layer(tmp_path, name):
    """Mixtral's `block_sparse_moe.experts.{e}.w1/w3/w2` and Qwen's per-expert `gate_proj`
    / `up_proj` / `down_proj` stacked into transformers 5's 3-D experts, Qwen2-MoE's shared
    expert and dense first layer; DeepSeek-V3's latent attention, groups and correction bias
    (a buffer, read from the files too)."""
    if name == "deepseek_v3":
        from test_hf_deepseek import MODELS as DEEPSEEK
        from test_hf_deepseek import random_deepseek

        random_deepseek(tmp_path / "hf", name, **DEEPSEEK["v3"][1])
    else:
        model_type, overrides = MODELS[name]
        random_hf(tmp_path / "hf", model_type, **overrides)
    import_hf(tmp_path / "hf", tmp_path / "ckpt")
    whole = verify(tmp_path / "hf", tmp_path / "ckpt", text=TEXT, layer_by_layer=False)
    _same(verify(tmp_path / "hf", tmp_path / "ckpt", text=TEXT, layer_by_layer=True), whole)
    assert whole["passed"] and whole["max_abs_logit_diff"] < 1e-4
    assert whole["top1_agreement"] == 1.0 and whole["tokens"] == 64  # its 64 positions


def test_gpt2_tied_with_learned_positions_and_the_built_in_text(tmp_path):
    """A GPT-2 of vocab.json + merges.txt (the checkpoint's tokenizer.json is used), its
    output layer tied to the word embeddings on both sides."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([DEFAULT_TEXT], trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    ))  # fmt: skip
    vocab = tok.get_vocab_size(with_added_tokens=True)
    random_hf(tmp_path / "hf", "gpt2", vocab_size=vocab, max_position_embeddings=256, n_inner=64,
              bos_token_id=0, eos_token_id=0, initializer_range=0.1)  # fmt: skip
    (tmp_path / "hf" / "tokenizer.json").unlink()  # GPT-2's own files instead
    tok.model.save(str(tmp_path / "hf"))
    import_hf(tmp_path / "hf", tmp_path / "ckpt")
    whole = verify(tmp_path / "hf", tmp_path / "ckpt", layer_by_layer=False)
    _same(verify(tmp_path / "hf", tmp_path / "ckpt", layer_by_layer=True), whole)
    assert whole["passed"] and whole["text"] == "built-in" and whole["tokens"] == 256
    assert whole["max_abs_logit_diff"] < 1e-4 and whole["top1_agreement"] == 1.0


def test_an_export_checks_against_its_checkpoint_and_bf16_runs(tmp_path):
    """A Llama at a trained model's scale (activations ~1): `export-hf --dtype bfloat16
    --verify` compares in fp32 with our weights rounded as the export rounded them (and
    `import-hf --dtype bfloat16 --verify` HF's as the import rounded them); a sharded
    export reads through its index layer by layer; both models in bf16 differ by rounding
    only, the same whole and layer by layer."""
    random_hf(tmp_path / "hf", "llama", num_hidden_layers=3, max_position_embeddings=256,
              initializer_range=0.02)  # fmt: skip
    ckpt, out = tmp_path / "ckpt", tmp_path / "export-bf16"
    import_hf(tmp_path / "hf", ckpt)
    (tmp_path / "text.txt").write_text(TEXT)
    result = _invoke("export-hf", "--ckpt", ckpt, "--out", out, "--dtype", "bfloat16",
                     "--verify", "--verify-text", tmp_path / "text.txt")  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "float32, whole model" in result.output and "PASSED" in result.output
    assert "verify" not in read_meta(find_checkpoint(ckpt))["imported_from"]  # not recorded
    rounded = verify(out, ckpt, text=TEXT, rounded="bfloat16")
    unrounded = verify(out, ckpt, text=TEXT)  # our fp32 weights against the bf16 export
    assert rounded["weights_rounded_to"] == "bfloat16" and unrounded["weights_rounded_to"] is None
    assert rounded["max_abs_logit_diff"] < 1e-5 < 100 * rounded["max_abs_logit_diff"]
    assert unrounded["max_abs_logit_diff"] > 1000 * rounded["max_abs_logit_diff"]
    # The other way: the fp32 files imported in bf16, HF's weights rounded alike for the check.
    result = _invoke("import-hf", tmp_path / "hf", "--out", tmp_path / "ckpt-bf16", "--dtype",
                     "bfloat16", "--verify", "--verify-text", tmp_path / "text.txt")  # fmt: skip
    assert result.exit_code == 0, result.output
    r = read_meta(find_checkpoint(tmp_path / "ckpt-bf16"))["imported_from"]["verify"]
    assert r["weights_rounded_to"] == "bfloat16" and r["max_abs_logit_diff"] < 1e-5
    export_hf(ckpt, tmp_path / "sharded", progress=False, max_shard_size="20KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    sharded = verify(tmp_path / "sharded", ckpt, text=TEXT, layer_by_layer=True)
    _same(verify(tmp_path / "sharded", ckpt, text=TEXT, layer_by_layer=False), sharded)
    assert sharded["passed"] and sharded["max_abs_logit_diff"] < 1e-5
    bf16 = verify(tmp_path / "hf", ckpt, text=TEXT, dtype="bfloat16")
    _same(verify(tmp_path / "hf", ckpt, text=TEXT, dtype="bfloat16", layer_by_layer=True), bf16)
    assert bf16["passed"] and bf16["tolerance"] == TOLERANCES["bfloat16"]
    assert 1e-3 < bf16["max_abs_logit_diff"] < 0.1 and bf16["top1_agreement"] > 0.95
    assert bf16["first_layer_off"] is None


def test_the_options(llama, tmp_path):
    help_text = " ".join(_invoke("import-hf", "-h").output.split())  # unwrapped
    assert all(f"{tol:g} in {dtype}" in help_text for dtype, tol in TOLERANCES.items())
    result = _invoke("import-hf", llama / "hf", "--out", tmp_path / "x", "--verify-tol", "1")
    assert result.exit_code == 2 and "--verify-tol go(es) with --verify" in result.output
    assert not (tmp_path / "x").exists()  # refused before anything is written


def test_a_model_giving_nan_fails_and_still_reports():
    """NaN logits (an overflow in fp16, say) fail, and the report prints and stays JSON."""
    hf, layers = torch.randn(1, 8, 16), [torch.randn(1, 8, 4)]
    r = _compare(hf, torch.full_like(hf, float("nan")), layers, [layers[0] * 2], 0.01, 1e-4)
    assert not r["passed"] and r["max_abs_logit_diff"] == "nan" and r["first_layer_off"] == 0
    text = format_report({**r, "hf_dir": "h", "checkpoint": "c", "tokens": 8, "text": "given",
                          "dtype": "float32", "mode": "whole model"})  # fmt: skip
    assert "max |Δ logit|    nan" in text and "FAILED: max |Δ logit| nan" in text
    json.dumps(r, allow_nan=False)
