"""The FLOP counts behind MFU and HFU, and what the training loop logs from them."""

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from megatrain.config import load_config
from megatrain.models import model_config
from megatrain.models.gpt import GPTConfig
from megatrain.plan.accounting import (
    gpt_hardware_flops_per_iteration as hardware_flops_per_iteration,
)
from megatrain.plan.accounting import gpt_model_flops_per_iteration as model_flops_per_iteration
from megatrain.run.loop import train
from megatrain.testing import random_documents, write_corpus

MODELS = Path(__file__).resolve().parents[3] / "pipelines" / "models"


def _paper_8_3b() -> GPTConfig:
    return model_config(load_config(MODELS / "gpt2-8.3b.toml"), 50257)


def test_model_flops_of_the_8_3b_config_by_hand():
    config = _paper_8_3b()
    assert config.recompute == "full"  # the paper's setting: MFU must not count it
    # B 512, s 1024, l 72, h 3072, V 50257 padded to a multiple of 128 x tp 8 = 51200:
    #   72 B s l h^2             = 72 * 512 * 1024 * 72 * 3072^2 = 2.5649e16
    #   72 B s l h^2 * s/6h      = 12 B s^2 h l                  = 1.4250e15
    #   72 B s l h^2 * V/12lh    = 6 B s h V                     = 4.9478e14
    assert config.vocab_size == 51200
    dense = 72 * 512 * 1024 * 72 * 3072**2
    attention = 12 * 512 * 1024**2 * 3072 * 72
    logits = 6 * 512 * 1024 * 3072 * 51200
    assert (dense, attention, logits) == (25649407252758528, 1424967069597696, 494780232499200)
    flops = model_flops_per_iteration(config, 512, 1024)
    assert flops == dense + attention + logits == 27569154554855424  # 2.757e16 per iteration
    # The same as the closed form, and about 6 x parameters x tokens plus the attention.
    b, s, n, h, v = 512, 1024, 72, 3072, 51200
    assert math.isclose(flops, 72 * b * s * n * h * h * (1 + s / (6 * h) + v / (12 * n * h)))
    # 6 x 8.3e9 parameters x 524288 tokens = 2.61e16; the s^2 terms add the rest.
    assert 1.0 < flops / (6 * 8.3e9 * b * s) < 1.1


@pytest.mark.parametrize("name", ["355m", "1.2b", "8.3b"])
def test_full_recompute_hfu_over_mfu_is_96_over_72(name):
    config = model_config(load_config(MODELS / f"gpt2-{name}.toml"), 50257)
    b, s, n, h, v = 512, 1024, config.num_layers, config.hidden_size, config.vocab_size
    model = model_flops_per_iteration(config, b, s)
    full = hardware_flops_per_iteration(config, b, s, "full")
    assert math.isclose(full, 96 * b * s * n * h * h * (1 + s / (6 * h) + v / (16 * n * h)))
    want = (96 * (1 + s / (6 * h) + v / (16 * n * h))) / (72 * (1 + s / (6 * h) + v / (12 * n * h)))
    assert math.isclose(full / model, want)
    assert 1.25 < full / model < 4 / 3  # one more forward of the layers, not of the logits
    # The config's own recompute mode is the default.
    own = hardware_flops_per_iteration(config, b, s, config.recompute)
    assert hardware_flops_per_iteration(config, b, s) == own


def test_selective_recompute_adds_the_attention_core_and_none_adds_nothing():
    config = _paper_8_3b()
    b, s, n, h, v = 8, 1024, 72, 3072, 51200
    model = model_flops_per_iteration(config, b, s)
    assert hardware_flops_per_iteration(config, b, s, "none") == model
    selective = hardware_flops_per_iteration(config, b, s, "selective")
    # QK^T and scores x V once more in each layer: 4 B s^2 h l.
    assert selective - model == 4 * b * s * s * h * n
    assert math.isclose(
        selective, 72 * b * s * n * h * h * (1 + 2 * s / (9 * h) + v / (12 * n * h))
    )
    with pytest.raises(ValueError, match="recompute must be one of"):
        hardware_flops_per_iteration(config, b, s, "partial")


def test_ffn_size_other_than_4h_is_counted():
    config = GPTConfig(
        num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=128,
        max_position_embeddings=32, ffn_hidden_size=100,
    )  # fmt: skip
    b, s, n, h, f, v = 3, 32, 2, 64, 100, 128
    forward = n * (2 * b * s * h * 3 * h + 2 * b * s * h * h + 2 * 2 * b * s * h * f)
    forward += n * 4 * b * s * s * h + 2 * b * s * h * v
    assert model_flops_per_iteration(config, b, s) == 3 * forward


def test_logged_record_at_full_recompute_has_hfu_above_mfu(tmp_path):
    """Two iterations of `train` in this process (a 1-rank gloo group); the log's MFU is the
    72-based count over the measured time and the peak, HFU the 96-based one."""
    rng = np.random.default_rng(0)
    splits = {
        "train": [random_documents(rng, 40, 1000, 8, 40)],
        "valid": [random_documents(rng, 10, 1000, 8, 40)],
    }
    corpus = write_corpus(tmp_path / "corpus", splits)
    out = tmp_path / "run"
    config = load_config(
        None,
        [
            f"data.corpus={str(corpus)!r}", f"training.output_dir={str(out)!r}",
            "model.num_layers=2", "model.hidden_size=32", "model.num_attention_heads=4",
            "model.max_position_embeddings=16", 'model.recompute="full"',
            "training.seq_length=16", "training.micro_batch_size=2",
            "training.global_batch_size=4", "training.train_iters=2",
            "training.eval_interval=2", "training.eval_iters=1",
            "logging.log_interval=1", "logging.tensorboard=false", "logging.peak_tflops=0.5",
        ],
    )  # fmt: skip
    threads = torch.get_num_threads()  # train() sets the CPU thread count of the process
    dist.init_process_group(
        "gloo", rank=0, world_size=1, init_method=f"file://{tmp_path / 'rendezvous'}"
    )
    try:
        train(config)
    finally:
        dist.destroy_process_group()
        torch.set_num_threads(threads)
    records = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records] == [1, 2]
    b, s, n, h, v = 4, 16, 2, 32, 1024  # vocabulary 1000 padded to 1024
    model = 72 * b * s * n * h * h * (1 + s / (6 * h) + v / (12 * n * h))
    hardware = 96 * b * s * n * h * h * (1 + s / (6 * h) + v / (16 * n * h))
    for r in records:
        seconds = r["ms_per_iter"] / 1e3
        assert math.isclose(r["tflops"], model / seconds / 1e12)
        assert math.isclose(r["mfu"], model / seconds / 1e12 / 0.5)
        assert math.isclose(r["hfu"], hardware / seconds / 1e12 / 0.5)
        assert r["hfu"] > r["mfu"]


def test_bert_flops_by_hand():
    """BERT 336M (Table 4) at seq 512: the layers as GPT's count them, the masked-LM head on
    the predicted 15% of the tokens only, and the pooler + SOP head once per sequence."""
    from megatrain.plan.accounting import BERT as bert
    from megatrain.plan.accounting import flops_per_iteration

    config = load_config(MODELS / "bert-336m.toml")
    cfg = model_config(config, 30522)
    b, s, n, h, v = 1024, 512, 24, 1024, cfg.vocab_size
    layers = n * (24 * b * s * h * h + 4 * b * s * s * h)
    heads = 2 * (0.15 * b * s) * h * (h + v) + 2 * b * h * (h + 2)
    assert bert.model_flops_per_iteration(cfg, b, s) == pytest.approx(3 * (layers + heads))
    model, hardware = flops_per_iteration("bert", cfg, b, s)
    assert hardware == model  # the config recomputes nothing
    cfg.recompute = "full"
    assert bert.hardware_flops_per_iteration(cfg, b, s) == pytest.approx(4 * layers + 3 * heads)


@pytest.mark.parametrize(
    "name", ["gpt2-1.2b", "bert-336m", "llama3-8b", "qwen3-30b-a3b", "mixtral-8x7b"]
)
def test_layer_gemms_are_the_counted_flops_and_weights(name):
    """accounting.layer_gemms, the one description of a layer the time model reads: its
    FLOPs per token are the closed forms of Narayanan et al. (GPT-2, BERT), with grouped K/V
    and SwiGLU's third matrix (Llama 3), kv_channels (Qwen3) and k active experts (MoE), and
    its weights every matrix layer_parameters counts."""
    from megatrain.plan.accounting import (
        expert_ffn_size,
        layer_gemms,
        layer_parameters,
        moe_layer_count,
        transformer_forward_flops,
    )

    cfg = model_config(load_config(MODELS / f"{name}.toml"), 32000)
    h, f, a = cfg.hidden_size, cfg.ffn_hidden_size, cfg.num_attention_heads
    d = cfg.kv_channels or h // a
    g = cfg.num_query_groups or a
    mlp = 3 if cfg.swiglu else 2
    attention = 2 * h * (2 * a * d + 2 * g * d)  # q and proj, k and v
    moe = cfg.num_moe_experts is not None and cfg.num_moe_experts > 0
    k_active = cfg.moe_router_topk * expert_ffn_size(cfg) if moe else 0
    shared = (cfg.moe_shared_expert_intermediate_size or 0) if moe else 0
    want = attention + 2 * mlp * h * (k_active + shared if moe else f)
    gemms = layer_gemms(cfg, moe)
    assert sum(x.flops_per_token for x in gemms if x.model_flops) == want
    # the router's 2 h E per token is timed, not counted (Megatron-LM's count)
    assert [x.name for x in gemms if not x.model_flops] == (["router"] if moe else [])
    if name == "gpt2-1.2b":
        assert want == 24 * h * h  # 8 h^2 attention + 16 h^2 MLP at f = 4h
        assert [x.name for x in gemms] == ["qkv", "proj", "fc1", "fc2"]
    if name == "llama3-8b":  # 8 query heads a group; gate, fc1 (up) and fc2 (down)
        assert [x.name for x in gemms] == ["q", "kv", "proj", "gate", "fc1", "fc2"]
        assert want == 2 * (2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336)
    # The whole forward pass of the layers: these per token, for every layer and token.
    b, s, n = 2, 512, cfg.num_layers
    layers = moe_layer_count(cfg)
    dense = sum(x.flops_per_token for x in layer_gemms(cfg) if x.model_flops)
    per_token = (n - layers) * dense + layers * sum(
        x.flops_per_token for x in layer_gemms(cfg, True) if x.model_flops
    )
    assert transformer_forward_flops(cfg, b, s) == (b * s * per_token, n * 4 * b * s * s * a * d)
    # Weights: the matrices of layer_parameters (E experts each), without biases and norms.
    experts = cfg.num_moe_experts if moe else 1
    matrices = sum(x.weights * (experts if x.name.startswith("experts.") else 1) for x in gemms)
    gate = h if moe and cfg.moe_shared_expert_gate else 0
    bias_and_norms = layer_parameters(cfg, moe) - matrices + gate
    qkv_bias = (a * d + 2 * g * d) if cfg.add_bias or cfg.add_qkv_bias else 0
    norms = (4 if cfg.normalization == "layernorm" else 2) * h
    qk_norms = (2 if cfg.normalization == "layernorm" else 1) * 2 * d if cfg.qk_layernorm else 0
    other_biases = (f * (mlp - 1) + 2 * h) if cfg.add_bias else 0
    assert bias_and_norms == qkv_bias + norms + qk_norms + other_biases + gate
    # per rank: the key/value groups split over tp, one whole group a rank when fewer
    for x in gemms:
        if x.split == "kv":
            assert x.per_rank(2 * g) == (h, 2 * d)
            assert x.per_rank(g // 2 or 1)[1] * (g // 2 or 1) == x.n
