"""Our MoELayer against transformers' own MoE modules, fp32, on random weights with every
weight, bias and buffer perturbed (HF zero-inits the routers and DeepSeek-V3's correction
bias, where ties would prove nothing): DeepSeek-V3's `DeepseekV3MoE` (sigmoid, correction
bias, groups ranked by their top-2 sum, normalized or not, routed_scaling_factor, shared
experts), DeepSeek-V2's `DeepseekV2Moe` (softmax, group_limited_greedy's max and plain
greedy, unnormalized, scaled), gpt-oss's `GptOssMLP` (the router's bias, top k of the logits
then their softmax, the clamped (up + 1) quick-GeGLU, per-expert biases on both GEMMs, the
interleaved gate/up columns through hf.moe's helpers); outputs and every gradient within
1e-5.  DeepSeek's first_k_dense_replace as a 0/1 moe_layer_freq, built."""

import pytest
import torch
from test_moe import _cfg as _moe_cfg
from test_moe import one_thread  # noqa: F401 (the fixture: tiny matrices, one thread)

from megatrain.hf.moe import gate_up_from_interleaved, gate_up_to_interleaved
from megatrain.models.common import cpu_generator, placement
from megatrain.models.mlp import ParallelMLP
from megatrain.models.moe import MoELayer
from megatrain.models.transformer_config import TransformerConfig

transformers = pytest.importorskip("transformers")

H, E, F, SHARED_F = 16, 8, 6, 12
TOL = {"rtol": 1e-5, "atol": 1e-5}


def _cfg(**fields) -> TransformerConfig:
    """test_moe's tiny MoE (h 16, dense ffn 24) with 8 experts of 6 and no aux loss (HF's
    modules compute none)."""
    base = dict(num_moe_experts=E, moe_ffn_hidden_size=F, moe_router_load_balancing_type="none")
    return _moe_cfg(**{**base, **fields})


def _perturbed(module: torch.nn.Module, seed: int, scale: float = 0.5) -> None:
    """Every parameter and floating buffer of `module` drawn anew: no zeros, no ties."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for t in [*module.parameters(), *module.buffers()]:
            if t.is_floating_point():
                t.copy_(torch.randn(t.shape, generator=g) * scale)


def _ours(cfg) -> MoELayer:
    layer = MoELayer(cfg, placement(cpu_generator(3), None, torch.float32), None)
    layer.train()
    return layer


def _run(module, x, target, hf: bool):
    """(output, d loss / d x) of one forward and backward, loss = sum(out x target)."""
    x = x.clone().requires_grad_()
    out = module(x)
    out = out[0] if isinstance(out, tuple) else out
    (out * target).sum().backward()
    return out.detach(), x.grad


def _compare(ours: MoELayer, hf: torch.nn.Module, grads: dict, seed: int) -> None:
    """Our layer and HF's module on the same tokens: outputs, input gradients, and each
    pair in `grads` (our parameter, a function of HF's module giving its gradient in our
    layout)."""
    g = torch.Generator().manual_seed(seed)
    x, target = torch.randn(5, 3, H, generator=g), torch.randn(5, 3, H, generator=g)
    ours_out, ours_dx = _run(ours, x, target, hf=False)
    hf_out, hf_dx = _run(hf, x, target, hf=True)
    torch.testing.assert_close(ours_out, hf_out, **TOL)
    torch.testing.assert_close(ours_dx, hf_dx, **TOL)
    for name, (param, hf_grad) in grads.items():
        assert param.grad is not None and param.grad.abs().max() > 0, name
        torch.testing.assert_close(param.grad, hf_grad(hf), **TOL, msg=name)


def _load_experts(ours: MoELayer, gate_up: torch.Tensor, down: torch.Tensor) -> None:
    """HF DeepSeek's fused experts (gate_up_proj [E, 2f, h]: gate rows, then up; down_proj
    [E, h, f]) into our weight1 [E, h, 2f] and weight2 [E, f, h]."""
    with torch.no_grad():
        ours.experts.weight1.copy_(gate_up.transpose(1, 2))
        ours.experts.weight2.copy_(down.transpose(1, 2))


def _load_shared(ours: MoELayer, mlp: torch.nn.Module) -> None:
    with torch.no_grad():
        s = ours.shared_expert
        s.gate.weight.copy_(mlp.gate_proj.weight)
        s.fc1.weight.copy_(mlp.up_proj.weight)
        s.fc2.weight.copy_(mlp.down_proj.weight)


def _deepseek_grads(ours: MoELayer) -> dict:
    s = ours.shared_expert
    return {
        "router": (ours.router.weight, lambda m: m.gate.weight.grad),
        "weight1": (ours.experts.weight1, lambda m: m.experts.gate_up_proj.grad.transpose(1, 2)),
        "weight2": (ours.experts.weight2, lambda m: m.experts.down_proj.grad.transpose(1, 2)),
        "shared gate": (s.gate.weight, lambda m: m.shared_experts.gate_proj.weight.grad),
        "shared up": (s.fc1.weight, lambda m: m.shared_experts.up_proj.weight.grad),
        "shared down": (s.fc2.weight, lambda m: m.shared_experts.down_proj.weight.grad),
    }


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_deepseek_v3_moe(gloo_world_of_one, norm_topk_prob):
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    hf_cfg = transformers.DeepseekV3Config(
        hidden_size=H, moe_intermediate_size=F, n_routed_experts=E, n_shared_experts=2,
        num_experts_per_tok=2, n_group=4, topk_group=2, routed_scaling_factor=2.5,
        norm_topk_prob=norm_topk_prob,
    )  # fmt: skip
    hf = DeepseekV3MoE(hf_cfg)
    _perturbed(hf, 1)
    # Megatron's default would rank groups by their top 2 // 2 = 1 score: HF's top 2 is set.
    ours = _ours(_cfg(
        moe_router_topk=2, moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True, moe_router_num_groups=4, moe_router_group_topk=2,
        moe_router_group_score_topk=2, moe_router_topk_scaling_factor=2.5,
        moe_router_norm_topk_prob=norm_topk_prob,
        moe_shared_expert_intermediate_size=2 * F,
    ))  # fmt: skip
    with torch.no_grad():
        ours.router.weight.copy_(hf.gate.weight)
        ours.router.expert_bias.copy_(hf.gate.e_score_correction_bias)
    _load_experts(ours, hf.experts.gate_up_proj, hf.experts.down_proj)
    _load_shared(ours, hf.shared_experts)
    _compare(ours, hf, _deepseek_grads(ours), seed=2)
    # The groups and the bias decide: without them the same weights route otherwise.
    x = torch.randn(15, H, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        _, grouped = ours.router(x, 3)
        ours.cfg.moe_router_num_groups = ours.cfg.moe_router_group_topk = None
        _, free = ours.router(x, 3)
    assert not torch.equal(grouped.sort(-1).values, free.sort(-1).values)


@pytest.mark.parametrize("topk_method", ["group_limited_greedy", "greedy"])
def test_deepseek_v2_moe(gloo_world_of_one, topk_method):
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2Moe

    groups = {"n_group": 4, "topk_group": 2} if topk_method != "greedy" else {}
    hf_cfg = transformers.DeepseekV2Config(
        hidden_size=H, moe_intermediate_size=F, n_routed_experts=E, n_shared_experts=2,
        num_experts_per_tok=3, topk_method=topk_method, routed_scaling_factor=1.5,
        norm_topk_prob=False, num_attention_heads=2, num_key_value_heads=2, **groups,
    )  # fmt: skip
    hf = DeepseekV2Moe(hf_cfg)
    _perturbed(hf, 4)
    ours_groups = {}
    if groups:  # a group's score its max: the top 1
        ours_groups = dict(moe_router_num_groups=4, moe_router_group_topk=2,
                           moe_router_group_score_topk=1)  # fmt: skip
    ours = _ours(_cfg(
        moe_router_topk=3, moe_router_pre_softmax=True, moe_router_norm_topk_prob=False,
        moe_router_topk_scaling_factor=1.5, moe_shared_expert_intermediate_size=2 * F,
        **ours_groups,
    ))  # fmt: skip
    with torch.no_grad():
        ours.router.weight.copy_(hf.gate.weight)
    _load_experts(ours, hf.experts.gate_up_proj, hf.experts.down_proj)
    _load_shared(ours, hf.shared_experts)
    _compare(ours, hf, _deepseek_grads(ours), seed=5)


def test_gpt_oss_mlp(gloo_world_of_one):
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    hf_cfg = transformers.GptOssConfig(
        hidden_size=H,
        intermediate_size=F,
        num_local_experts=E,
        num_experts_per_tok=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=8,
    )
    hf = GptOssMLP(hf_cfg)
    _perturbed(hf, 6, scale=1.5)  # large enough that the clamps at 7 act
    assert hf.experts.limit == 7.0 and hf.experts.alpha == 1.702
    ours = _ours(_cfg(
        add_bias=True, quick_geglu=True, glu_linear_offset=1.0, activation_func_clamp_value=7.0,
        moe_router_topk=2, moe_router_pre_softmax=False,
    ))  # fmt: skip
    ex = hf.experts
    with torch.no_grad():
        ours.router.weight.copy_(hf.router.weight)
        ours.router.bias.copy_(hf.router.bias)
        ours.experts.weight1.copy_(gate_up_from_interleaved(ex.gate_up_proj))
        ours.experts.bias1.copy_(gate_up_from_interleaved(ex.gate_up_proj_bias))
        ours.experts.weight2.copy_(ex.down_proj)
        ours.experts.bias2.copy_(ex.down_proj_bias)
    # The clamps act on these tokens: some gate above 7, some up below -7.
    x = torch.randn(5, 3, H, generator=torch.Generator().manual_seed(7))
    gate_up = x.reshape(-1, H) @ ex.gate_up_proj[0] + ex.gate_up_proj_bias[0]
    assert (gate_up[:, ::2] > 7).any() and (gate_up[:, 1::2] < -7).any()
    e = ours.experts
    grads = {
        "router": (ours.router.weight, lambda m: m.router.weight.grad),
        "router bias": (ours.router.bias, lambda m: m.router.bias.grad),
        "weight1": (e.weight1, lambda m: gate_up_from_interleaved(m.experts.gate_up_proj.grad)),
        "bias1": (e.bias1, lambda m: gate_up_from_interleaved(m.experts.gate_up_proj_bias.grad)),
        "weight2": (e.weight2, lambda m: m.experts.down_proj.grad),
        "bias2": (e.bias2, lambda m: m.experts.down_proj_bias.grad),
    }
    _compare(ours, hf, grads, seed=7)
    # The helper the importer will use goes both ways.
    assert torch.equal(gate_up_to_interleaved(e.weight1.detach()), ex.gate_up_proj.detach())


def test_first_k_dense_replace_is_a_moe_layer_freq_list(gloo_world_of_one):
    """HF's first_k_dense_replace = 1 over 3 layers: moe_layer_freq [0, 1, 1], the dense
    layer of intermediate_size (ffn_hidden_size), the others routed experts of
    moe_intermediate_size and the shared experts."""
    from megatrain.models import build_model_chunks

    cfg = _cfg(num_layers=3, moe_layer_freq=[0, 1, 1], moe_router_topk=2,
               moe_shared_expert_intermediate_size=SHARED_F)  # fmt: skip
    (model,) = build_model_chunks("llama", cfg)
    mlps = [layer.mlp for layer in model.layers.values()]
    assert type(mlps[0]) is ParallelMLP and mlps[0].fc1.weight.shape == (24, H)
    for mlp in mlps[1:]:
        assert isinstance(mlp, MoELayer)
        assert mlp.experts.weight1.shape == (E, H, 2 * F)
        assert mlp.shared_expert.fc1.weight.shape == (SHARED_F, H)
