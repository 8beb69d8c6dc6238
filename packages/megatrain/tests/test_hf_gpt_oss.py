"""gpt-oss through Hugging Face both ways (`hf.gpt_oss`): a random tiny GptOssForCausalLM with
every weight, bias and sink perturbed (HF starts the router and biases at zero), a sliding
window of 3 keys on its first layer and full attention on its second, YaRN scaling and the
experts' clamp acting, imports with fp32 logits within 1e-4 of HF's eager path, exports to
bit-equal weights that give the same logits, generates as HF does (the cached path with the
window-bounded cache and the sinks); its parameters are counted as built.  OpenAI's MXFP4
files (the experts as `*_blocks` and `*_scales`) import as their weights dequantised by
transformers."""

import json
import shutil

import pytest
import torch
from test_hf_llama_families import both_ways, random_hf
from test_hf_quantized import random_mxfp4, write_files

from megacore import parallel_state as ps
from megatrain.testing import world_of_one

GPT_OSS = dict(
    num_local_experts=4, num_experts_per_tok=2, intermediate_size=32, head_dim=16,
    sliding_window=3, layer_types=["sliding_attention", "full_attention"],
    rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                     "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                     "original_max_position_embeddings": 16},
    tie_word_embeddings=False, swiglu_limit=2.0,
)  # fmt: skip


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpt-oss")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        hf = random_hf(root / "gpt_oss", "gpt_oss", **GPT_OSS)
        with world_of_one(root / "rendezvous"):
            ps.initialize_model_parallel(1, 1)
            return both_ways(root, "gpt_oss", hf)
    finally:
        ps.destroy_model_parallel()
        torch.set_num_threads(threads)


def test_gpt_oss_both_ways_exact(gpt_oss):
    r = gpt_oss
    assert r["logits_scale"] > 1e-2 and r["logits_max_diff"] < 1e-4, r["logits_max_diff"]
    assert r["export_equal"] and r["export_logits_diff"] == 0.0
    assert r["architecture"] == "GptOssForCausalLM"
    cached, uncached, theirs = r["generated"]
    assert cached == uncached == theirs and len(cached) == 12
    assert r["counted"] == r["built"]  # the sinks, router and expert biases counted
    assert r["unwindowed_logits_diff"] > 1e-2  # the window mattered
    assert r["model"]["window_size"] == 3 and r["model"]["num_moe_experts"] == 4
    config = r["config"]
    assert config["sliding_window"] == 3 and config["swiglu_limit"] == 2.0
    assert config["layer_types"] == ["sliding_attention", "full_attention"]
    assert config["rope_parameters"]["rope_type"] == "yarn"
    assert config["rope_parameters"]["truncate"] is False


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"swiglu_alpha": 1.5}, r"swiglu_alpha is 1.5: expected 1.702"),
        ({"attention_bias": False}, r"attention_bias is False"),
        ({"num_experts_per_tok": 9}, r"num_experts_per_tok is 9: expected 1 to the 4"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}},
         r"rope type yarn without a number for original_max_position_embeddings"),
        ({"sliding_window": 0}, r"sliding_window is 0: expected a positive"),
    ],
)  # fmt: skip
def test_gpt_oss_fields_we_do_not_compute_are_refused(tmp_path, change, message, monkeypatch):
    from megatrain.hf import HFFormatError, import_hf

    (tmp_path / "hf").mkdir()
    config = {"model_type": "gpt_oss", "vocab_size": 96, "hidden_size": 32,
              "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_local_experts": 4, "eos_token_id": 2, **change}  # fmt: skip
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    monkeypatch.setattr("safetensors.safe_open", None)  # the weights are never opened
    with pytest.raises(HFFormatError, match=message):
        import_hf(tmp_path / "hf", tmp_path / "ckpt", tokenizer_file=tmp_path / "none.json")


MXFP4 = {"quant_method": "mxfp4",
         "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                    "model.embed_tokens", "lm_head"]}  # fmt: skip


def test_mxfp4_files_import_as_their_dequantised_weights(tmp_path):
    """The experts stored as OpenAI stores them (gate_up_proj [E, 2f, h/32, 16] blocks and
    [E, 2f, h/32] scales; down_proj [E, h, f/32, 16]) import to the checkpoint of the same
    model whose experts are transformers' dequantisation of those blocks."""
    from safetensors.torch import load_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from megatrain.checkpoint.load import read_full_state
    from megatrain.hf import import_hf

    random_hf(tmp_path / "hf", "gpt_oss", **GPT_OSS)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    state = load_file(tmp_path / "hf" / "model.safetensors")
    packed, plain = {}, {}
    for i, (key, t) in enumerate(sorted(state.items())):
        if key.endswith(("experts.gate_up_proj", "experts.down_proj")):
            E, h, w = t.shape  # [E, in, out]: blocks run along `in`
            blocks, scales = random_mxfp4(E, w, h // 32, seed=i)
            packed[f"{key}_blocks"], packed[f"{key}_scales"] = blocks, scales
            plain[key] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
            assert plain[key].shape == t.shape, key
        else:
            packed[key] = plain[key] = t
    for name, tensors, quantization in (("mxfp4", packed, MXFP4), ("plain", plain, None)):
        directory = tmp_path / name
        directory.mkdir()
        write_files(directory, tensors, quantization, dtype="float32")
        fields = {**config, "dtype": "float32"}
        if quantization:
            fields["quantization_config"] = quantization
        (directory / "config.json").write_text(json.dumps(fields))
        shutil.copy(tmp_path / "hf" / "tokenizer.json", directory)
        import_hf(directory, tmp_path / f"{name}-ckpt")
    _, ours = read_full_state(tmp_path / "mxfp4-ckpt", progress=False)
    _, theirs = read_full_state(tmp_path / "plain-ckpt", progress=False)
    assert set(ours) == set(theirs)
    for key in ours:
        torch.testing.assert_close(ours[key], theirs[key], rtol=0, atol=0, msg=key)
    assert not torch.equal(
        ours["layers.0.mlp.experts.weight1"], ours["layers.1.mlp.experts.weight1"]
    )
