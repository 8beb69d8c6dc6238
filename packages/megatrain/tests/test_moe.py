"""The mixture-of-experts layer (megatrain.models.moe) on one process, fp32: MoELayer against a
per-token sum over each token's chosen experts written out here (Mixtral's routing, a
shared expert with Qwen2-MoE's gate, capacity drops), the experts drawn the same at every
expert layout, the config's refusals, and pipelines/models/mixtral-tiny.toml training
(the loss falls, the aux loss reported, DeepSeek-V3's expert bias moved once per step).
The routing functions themselves: megacore/tests/test_moe_core.py."""

import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from megacore import moe
from megatrain.config import (
    MOE_DROP_POLICIES,
    MOE_LOAD_BALANCING_TYPES,
    MOE_SCORE_FUNCTIONS,
    ConfigError,
    load_config,
    validate,
)
from megatrain.models import model_config
from megatrain.models.common import cpu_generator, placement
from megatrain.models.moe import MoELayer, is_moe_layer, moe_layers
from megatrain.models.transformer_config import TransformerConfig
from megatrain.testing import world_of_one, write_counting_corpus

MODELS = Path(__file__).resolve().parents[3] / "pipelines" / "models"
E, K, H = 4, 2, 16


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny matrices: one thread is fastest, and spares a loaded machine's cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _cfg(**fields) -> TransformerConfig:
    base = dict(
        num_layers=2, hidden_size=H, num_attention_heads=2, vocab_size=64,
        max_position_embeddings=32, ffn_hidden_size=24, swiglu=True, add_bias=False,
        normalization="rmsnorm", hidden_dropout=0.0, attention_dropout=0.0,
        num_moe_experts=E, moe_router_topk=K, moe_ffn_hidden_size=12, init_method_std=0.3,
    )  # fmt: skip
    return TransformerConfig(**{**base, **fields})


def _layer(cfg, parallel=None, seed=7) -> MoELayer:
    return MoELayer(cfg, placement(cpu_generator(seed), None, torch.float32), parallel)


def _swiglu(x, gate, up, down):
    return (F.silu(x @ gate) * (x @ up)) @ down


def _per_token(layer: MoELayer, x: torch.Tensor, capacity: int | None) -> torch.Tensor:
    """Each token: the softmax over the router's logits, its top k renormalized (HF Mixtral),
    the weighted sum of those experts' SwiGLU MLPs; an expert full (`capacity`, earliest
    tokens first) skips the choice; plus the shared expert times its sigmoid gate."""
    tokens = x.reshape(-1, H)
    w1, w2 = layer.experts.weight1, layer.experts.weight2
    taken = [0] * E
    rows = []
    for t in range(tokens.shape[0]):
        p = torch.softmax(layer.router.weight @ tokens[t], -1)
        top = p.topk(K)
        weights = top.values / top.values.sum()
        row = torch.zeros(H)
        for w, e in zip(weights, top.indices.tolist(), strict=True):
            if capacity is not None and taken[e] >= capacity:
                continue
            taken[e] += 1
            gate, up = w1[e].chunk(2, dim=-1)
            row = row + w * _swiglu(tokens[t], gate, up, w2[e])
        rows.append(row)
    out = torch.stack(rows)
    if layer.shared_expert is not None:
        s = layer.shared_expert
        shared = _swiglu(tokens, s.gate.weight.t(), s.fc1.weight.t(), s.fc2.weight.t())
        out = out + shared * torch.sigmoid(tokens @ layer.shared_expert_gate.weight.t())
    return out.view(x.shape)


@pytest.mark.parametrize("capacity_factor", [None, 0.75])
def test_moe_layer_is_the_per_token_sum_of_its_chosen_experts(gloo_world_of_one, capacity_factor):
    cfg = _cfg(
        moe_shared_expert_intermediate_size=20,
        moe_shared_expert_gate=True,
        moe_expert_capacity_factor=capacity_factor,
        moe_token_drop_policy="position",
    )
    x = torch.randn(6, 2, H, generator=torch.Generator().manual_seed(0))
    target = torch.randn(6, 2, H, generator=torch.Generator().manual_seed(1))
    layer = _layer(cfg)
    capacity = None if capacity_factor is None else moe.expert_capacity(12, E, K, 0.75)
    results = []
    for forward in (lambda: layer(x)[0], lambda: _per_token(layer, x, capacity)):
        layer.zero_grad()
        out = forward()
        (out * target).sum().backward()
        results.append([out.detach()] + [p.grad.clone() for p in layer.parameters()])
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # The layer's load: every choice counted once, the dropped ones apart.
    assert layer.tokens_per_expert.sum() + layer.dropped == 12 * K
    assert (layer.dropped > 0) == (capacity_factor is not None)
    if capacity_factor is not None:
        assert layer.tokens_per_expert.max() <= capacity
    # The per-expert loop gives the grouped GEMM's numbers.
    loop = _layer(_cfg(moe_grouped_gemm=False, moe_shared_expert_intermediate_size=20,
                       moe_shared_expert_gate=True, moe_expert_capacity_factor=capacity_factor,
                       moe_token_drop_policy="position"))  # fmt: skip
    torch.testing.assert_close(loop(x)[0], results[0][0], rtol=1e-5, atol=1e-6)


def test_experts_are_drawn_the_same_at_every_expert_layout():
    """What H2's layouts rely on: a rank of (ep, etp) holds its slice of one process's experts."""
    cfg = _cfg()
    full = _layer(cfg)
    swiglu_shard = moe.fc1_shard
    for ep, etp in ((2, 1), (4, 1), (2, 2), (1, 2)):
        local = E // ep
        for r in range(ep):
            for q in range(etp):
                place = SimpleNamespace(ep_rank=r, ep_size=ep, etp_rank=q, etp_size=etp)
                part = _layer(cfg, place)
                assert torch.equal(part.router.weight, full.router.weight)
                ids = slice(r * local, (r + 1) * local)
                w1 = swiglu_shard(full.experts.weight1[ids], q, etp, swiglu=True)
                assert torch.equal(part.experts.weight1, w1)
                w2 = full.experts.weight2[ids].chunk(etp, dim=1)[q]
                assert torch.equal(part.experts.weight2, w2)
    assert not torch.equal(full.experts.weight1[0], full.experts.weight1[1])
    assert not torch.equal(_layer(cfg, seed=8).experts.weight1, full.experts.weight1)
    assert [is_moe_layer(_cfg(moe_layer_freq=2), i) for i in range(4)] == [1, 0, 1, 0]
    assert [is_moe_layer(_cfg(moe_layer_freq=[0, 1]), i) for i in range(2)] == [0, 1]
    assert not is_moe_layer(_cfg(num_moe_experts=None), 0)


MOE = ['model.kind="llama"', "model.num_layers=2", "model.num_moe_experts=4"]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (['model.kind="bert"', "model.num_moe_experts=4"],
         "model.num_moe_experts: MoE is built for the causal kinds gpt and llama"),
        ([*MOE, "model.moe_router_topk=5"],
         r"model.moe_router_topk \(5\) is above model.num_moe_experts \(4\)"),
        ([*MOE, "model.moe_expert_capacity_factor=0"], "moe_expert_capacity_factor must be > 0"),
        ([*MOE, 'model.moe_router_score_function="relu"'], "moe_router_score_function: expected"),
        ([*MOE, 'model.moe_token_drop_policy="random"'], "moe_token_drop_policy: expected"),
        ([*MOE, "model.moe_layer_freq=[1, 0, 1]"], "model.moe_layer_freq: a list needs"),
        ([*MOE, "model.moe_router_enable_expert_bias=true"], "needs model.moe_router_score"),
        ([*MOE, "model.moe_shared_expert_gate=true"], "set model.moe_shared_expert_inter"),
        ([*MOE, "model.moe_router_num_groups=2"], "moe_router_group_topk go together"),
        ([*MOE, "model.moe_router_num_groups=3", "model.moe_router_group_topk=1"],
         r"model.num_moe_experts \(4\) is not divisible by model.moe_router_num_groups \(3\)"),
        ([*MOE, "model.moe_router_num_groups=2", "model.moe_router_group_topk=3"],
         r"model.moe_router_group_topk \(3\) must be 1 to model.moe_router_num_groups \(2\)"),
        ([*MOE, "model.moe_router_num_groups=4", "model.moe_router_group_topk=1"],
         r"model.moe_router_topk \(2\) is above the experts of model.moe_router_group_topk"),
        ([*MOE, "model.moe_router_num_groups=2", "model.moe_router_group_topk=2",
          "model.moe_router_topk=1"], "set model.moe_router_group_score_topk"),
        ([*MOE, "model.moe_router_num_groups=2", "model.moe_router_group_topk=1",
          "model.moe_router_group_score_topk=3"], r"moe_router_group_score_topk \(3\) must be"),
        ([*MOE, "model.moe_router_group_score_topk=2"], "ranks the groups of group-limited"),
        ([*MOE, "model.moe_group_limited_dispatch=true"], "relies on group-limited routing"),
        ([*MOE, "model.moe_router_num_groups=2", "model.moe_router_group_topk=1",
          "model.moe_group_limited_dispatch=true", "model.moe_token_dispatcher_type='allgather'"],
         "is the all-to-all's"),
        (['model.kind="gpt"', "model.quick_geglu=true"], "shapes the gated MLP: set model.swiglu"),
        ([*MOE, "model.activation_func_clamp_value=0"], "must be a finite number > 0"),
        ([*MOE, "training.compile=true"], "compiled MoE layers are not built"),
    ],
)  # fmt: skip
def test_bad_moe_settings_are_refused_naming_the_field(overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate(load_config(None, overrides))


def test_the_configs_choices_are_megacores():
    """config.py names them without importing torch."""
    assert MOE_SCORE_FUNCTIONS == moe.SCORE_FUNCTIONS
    assert MOE_LOAD_BALANCING_TYPES == moe.LOAD_BALANCING_TYPES
    assert MOE_DROP_POLICIES == moe.DROP_POLICIES


SMALL = [
    "model.num_layers=2", "model.hidden_size=64", "model.ffn_hidden_size=64",
    "model.max_position_embeddings=64", "training.seq_length=32", "training.micro_batch_size=4",
    "training.global_batch_size=8", "optimizer.lr_warmup_iters=2", "data.verify_sha256=false",
]  # fmt: skip


def test_mixtral_tiny_trains_and_the_expert_bias_moves_once_a_step(tmp_path):
    from megatrain.run.setup import build_run
    from megatrain.run.step import train_step

    corpus = write_counting_corpus(tmp_path / "corpus", 200)
    path = MODELS / "mixtral-tiny.toml"
    config = load_config(path, [*SMALL, f"data.corpus={str(corpus)!r}", "training.train_iters=30"])
    assert model_config(config, 200).num_moe_experts == 8
    with world_of_one(tmp_path / "rendezvous"):
        run = build_run(config, torch.device("cpu"))
        steps = [train_step(run) for _ in range(30)]
        layers = moe_layers(run.chunks)
        assert len(layers) == 2
        # Every choice of the step's two microbatches counted (dropless).
        assert all(m.tokens_per_expert.sum() == 8 * 32 * 2 for m in layers)
    losses = [s["loss"] for s in steps]
    assert losses[0] > math.log(200) - 0.3
    # Measured: 5.29 at the first step, 4.3 over the last five.
    assert sum(losses[-5:]) / 5 < losses[0] - 0.6, losses
    # The load-balancing loss without its coefficient: 1 when balanced, up to E / k.
    assert all(0.9 < s["moe_aux_loss"] < 8 / 2 for s in steps), [s["moe_aux_loss"] for s in steps]

    rate = 0.01
    biased = [
        'model.moe_router_score_function="sigmoid"', "model.moe_router_enable_expert_bias=true",
        f"model.moe_router_bias_update_rate={rate}", "model.moe_aux_loss_coeff=0.0",
        "training.train_iters=2",
    ]  # fmt: skip
    config = load_config(path, [*SMALL, f"data.corpus={str(corpus)!r}", *biased])
    with world_of_one(tmp_path / "rendezvous"):
        run = build_run(config, torch.device("cpu"))
        biases = [[m.router.expert_bias.clone() for m in moe_layers(run.chunks)]]
        for _ in range(2):
            stats = train_step(run)
            assert "moe_aux_loss" not in stats
            layers = moe_layers(run.chunks)
            for before, m in zip(biases[-1], layers, strict=True):
                counts = m.tokens_per_expert.float()
                step = torch.sign(counts.mean() - counts) * rate
                torch.testing.assert_close(m.router.expert_bias, before + step)
            biases.append([m.router.expert_bias.clone() for m in layers])
        assert any(b.abs().sum() > 0 for b in biases[-1])
        assert all(m.router.expert_bias.grad is None for m in layers)
