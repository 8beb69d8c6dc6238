"""Multi-latent attention (the "mla" kind, DeepSeek-V2/V3) and YaRN rotary scaling.

- The module against transformers' DeepseekV3Attention and DeepseekV2Attention (with and
  without the query latent, YaRN with mscale != mscale_all_dim, so both the rotary tables'
  attention factor and the softmax's mscale^2 are not 1), every weight perturbed: outputs and
  every gradient within 1e-5 in fp32; generation's cached latent gives the uncached outputs.
- YaRN's inverse frequencies and attention factor equal HF's `_compute_yarn_parameters` for
  DeepSeek-V3's, DeepSeek-V2-Lite's and gpt-oss's parameters; the tables equal HF's rotary
  embeddings' (gpt-oss's attention factor in them).
- Selective recompute takes the same gradients and saves the latent, not the up-projected
  keys and values (the saved tensors' shapes, seen by saved_tensors_hooks).
- Real gloo groups: the module at tp 2, with and without sequence parallelism and the query
  latent, equals one process (output, input gradient, every parameter's gradient gathered);
  a tiny Llama with MLA trains the one-process steps at tp 2 + sp (with gradient
  accumulation fusion; also with packed documents), pp 2 (ZB-H1, selective recompute) and cp 2
  with each comm type (p2p, allgather, MLA's own latent gather; packed documents, selective
  recompute, no query latent with an MTP depth), pp 2 under 1F1B with the MTP depth on the
  last stage, dp 2 with the distributed optimizer (packed documents) and fully sharded (with
  the MTP depth), pp 2 interleaved (4 layers); uneven stages (4 layers and an MTP depth on
  packed documents, parallel.pipeline_model_parallel_layout): 3 + 1 under 1F1B, 1 + 3 under
  ZB-H1, interleaved with a last chunk of no layer ("Et|tt|t|mL") and with a middle one
  ("Ett||t|tmL", also fully sharded), each rank's chunks holding the layout's layers; and a
  checkpoint of the 3 + 1 stages going on at tp 2 + sp, all in one 2-rank spawn.
- Refusals naming the field.  Accounting: DeepSeek-V2-Lite's and DeepSeek-V3's parameters
  against HF's models (15.7B, 671B), MLA's FLOPs as Megatron-LM's formula, the activations
  selective recompute keeps against what autograd keeps.
"""

import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from megacore import parallel_state as ps
from megacore import tensor_parallel as tp
from megacore.testing import run_distributed
from megatrain.config import ConfigError, load_config, validate
from megatrain.models.attention.kv_cache import KVCache
from megatrain.models.attention.multi_latent import MultiLatentAttention
from megatrain.models.attention.rope import (
    _rope_tables,
    rope_attention_factor,
    rope_frequencies,
    softmax_mscale,
)
from megatrain.models.common import cpu_generator, placement
from megatrain.models.layout import ParallelContext
from megatrain.models.transformer_config import TransformerConfig, YarnScaling
from megatrain.testing import QUIET_LOGGING, TINY_MODEL

TOL = 1e-5
H, HEADS, B, S = 32, 4, 2, 16
# Sizes all distinct, so that a saved tensor's shape says what it is: the query latent 12,
# the key/value latent 8, no-rope 6, rope 4 (q/k heads of 10), values 5 (kv_b's 11 a head).
SIZES = dict(kv_lora_rank=8, qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=5)
# A pretraining context of 4 under the 16 tokens: the interpolated frequencies are used.
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
        "original_max_position_embeddings": 4, "beta_fast": 32.0, "beta_slow": 1.0,
        "mscale": 0.707, "mscale_all_dim": 1.0}  # fmt: skip
# Our parameter names -> HF's.
HF_NAMES = {
    "q_a.weight": "q_a_proj.weight",
    "q_a_norm.weight": "q_a_layernorm.weight",
    "q_b.weight": "q_b_proj.weight",
    "q.weight": "q_proj.weight",
    "kv_a.weight": "kv_a_proj_with_mqa.weight",
    "kv_a_norm.weight": "kv_a_layernorm.weight",
    "kv_b.weight": "kv_b_proj.weight",
    "proj.weight": "o_proj.weight",
}


def _yarn(rope: dict) -> YarnScaling:
    return YarnScaling(
        factor=rope["factor"],
        original_max_position_embeddings=rope["original_max_position_embeddings"],
        beta_fast=rope.get("beta_fast", 32.0),
        beta_slow=rope.get("beta_slow", 1.0),
        mscale=rope.get("mscale", 0.0),
        mscale_all_dim=rope.get("mscale_all_dim", 0.0),
        truncate=rope.get("truncate", True),
    )


def _cfg(q_lora_rank, rope: dict | None, **kw) -> TransformerConfig:
    return TransformerConfig(
        num_layers=2, hidden_size=H, num_attention_heads=HEADS, vocab_size=64,
        max_position_embeddings=64, normalization="rmsnorm", position_embedding="rope",
        rotary_base=10000.0, layernorm_epsilon=1e-6, add_bias=False, attention_dropout=0.0,
        rope_scaling=_yarn(rope) if rope else None, attention_type="mla",
        q_lora_rank=q_lora_rank, kv_lora_rank=SIZES["kv_lora_rank"],
        qk_head_dim=SIZES["qk_nope_head_dim"], qk_pos_emb_head_dim=SIZES["qk_rope_head_dim"],
        v_head_dim=SIZES["v_head_dim"], **kw,
    )  # fmt: skip


def _mla(cfg: TransformerConfig, seed: int = 1) -> MultiLatentAttention:
    place = placement(cpu_generator(seed), "cpu", torch.float32)
    return MultiLatentAttention(cfg, place, ParallelContext.from_process_groups())


def _hf_attention(version: int, q_lora_rank, rope: dict | None):
    """HF's attention (V2 or V3) with every weight perturbed, and a function of
    (x [b, s, h]) -> its output, causal over the positions 0..s-1."""
    import transformers
    from transformers.models.deepseek_v2 import modeling_deepseek_v2 as v2
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as v3

    make = transformers.DeepseekV3Config if version == 3 else transformers.DeepseekV2Config
    config = make(
        hidden_size=H, num_attention_heads=HEADS, num_key_value_heads=HEADS,
        q_lora_rank=q_lora_rank, max_position_embeddings=64, rms_norm_eps=1e-6,
        rope_parameters=rope or {"rope_type": "default", "rope_theta": 10000.0}, **SIZES,
    )  # fmt: skip
    config._attn_implementation = "eager"
    module = v3 if version == 3 else v2
    Attention = module.DeepseekV3Attention if version == 3 else module.DeepseekV2Attention
    rotary = module.DeepseekV3RotaryEmbedding if version == 3 else module.DeepseekV2RotaryEmbedding
    torch.manual_seed(version)
    hf, rotary = Attention(config, 0), rotary(config)
    with torch.no_grad():
        for name, p in hf.named_parameters():  # norms about 1, as trained ones are
            p.normal_(1.0 if "layernorm" in name else 0.0, 0.2)

    def run(x):
        b, s = x.shape[:2]
        positions = torch.arange(s).expand(b, s)
        mask = torch.full((s, s), float("-inf")).triu(1).expand(b, 1, s, s)
        if version == 3:
            return hf(x, rotary(x, positions), mask)[0]
        return hf(x, attention_mask=mask, position_embeddings=rotary(x, positions))[0]

    return hf, run


def _copy_from_hf(ours, hf) -> dict:
    theirs = dict(hf.named_parameters())
    with torch.no_grad():
        for name, p in ours.named_parameters():
            p.copy_(theirs[HF_NAMES[name]])
    return theirs


HF_CASES = {
    "v3-q-latent-yarn": (3, 12, YARN),
    "v3-direct-q-yarn": (3, None, YARN),
    "v2-q-latent-yarn": (2, 12, YARN),
    "v2-direct-q-no-scaling": (2, None, None),
}


@pytest.mark.parametrize("case", HF_CASES)
def test_mla_equals_hf_with_gradients(case, gloo_world_of_one):
    version, q_lora_rank, rope = HF_CASES[case]
    hf, run_hf = _hf_attention(version, q_lora_rank, rope)
    ours = _mla(_cfg(q_lora_rank, rope))
    theirs = _copy_from_hf(ours, hf)
    assert len(theirs) == len(list(ours.parameters()))
    x = torch.randn(B, S, H, generator=torch.Generator().manual_seed(0), requires_grad=True)
    expected = run_hf(x)
    x_ours = x.detach().transpose(0, 1).clone().requires_grad_()
    out, bias = ours(x_ours)
    assert bias is None
    torch.testing.assert_close(out.transpose(0, 1), expected, rtol=TOL, atol=TOL)
    grad = torch.randn(expected.shape, generator=torch.Generator().manual_seed(1))
    expected.backward(grad)
    out.backward(grad.transpose(0, 1))
    torch.testing.assert_close(x_ours.grad.transpose(0, 1), x.grad, rtol=TOL, atol=TOL)
    for name, p in ours.named_parameters():
        torch.testing.assert_close(p.grad, theirs[HF_NAMES[name]].grad, rtol=TOL, atol=TOL)
    if rope:  # both of YaRN's factors were in play
        assert rope_attention_factor(ours.cfg.rope_scaling) != 1.0 and ours.q_scale != 1.0
    # Generation: a prompt of 10, then one token at a time from the cached latent.
    cache = KVCache(max_length=S)
    with torch.no_grad():
        steps = []
        for start, end in [(0, 10), *((i, i + 1) for i in range(10, S))]:
            steps.append(ours(x_ours[start:end].detach(), cache=cache, layer_id=0)[0])
            cache.offset = end
    torch.testing.assert_close(torch.cat(steps), out.detach(), rtol=TOL, atol=TOL)
    assert cache.layers[0][0].shape == (B, 1, S, SIZES["kv_lora_rank"])


def _hf_yarn(rope: dict, head_dim: int):
    import transformers
    from transformers.modeling_rope_utils import _compute_yarn_parameters

    config = transformers.DeepseekV3Config(
        hidden_size=64, num_attention_heads=1, qk_rope_head_dim=head_dim, rope_parameters=rope
    )
    return config, _compute_yarn_parameters(config)


YARN_CONFIGS = {
    # DeepSeek-V3 / R1's config.json rope_scaling
    "deepseek-v3": ({"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                     "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1,
                     "mscale": 1.0, "mscale_all_dim": 1.0}, 64),
    "deepseek-v2-lite": ({"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                          "original_max_position_embeddings": 4096, "beta_fast": 32,
                          "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707}, 64),
    "gpt-oss": ({"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0,
                 "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                 "original_max_position_embeddings": 4096}, 64),
    "gpt-oss-truncated": ({"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0,
                           "beta_fast": 32.0, "beta_slow": 1.0,
                           "original_max_position_embeddings": 4096}, 64),
}  # fmt: skip


@pytest.mark.parametrize("name", YARN_CONFIGS)
def test_yarn_frequencies_and_factors_equal_hf(name):
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
        DeepseekV3RotaryEmbedding,
        yarn_apply_mscale,
    )

    rope, dim = YARN_CONFIGS[name]
    config, (inv_freq, attention_factor) = _hf_yarn(rope, dim)
    yarn = _yarn(rope)
    ours = rope_frequencies(dim, rope["rope_theta"], yarn)
    assert torch.equal(ours, inv_freq), name
    assert rope_attention_factor(yarn) == attention_factor, name
    assert softmax_mscale(yarn) * 0.125 == yarn_apply_mscale(rope, 0.125), name
    # The tables a layer reads, the attention factor in them, as HF's rotary embedding's.
    positions = torch.arange(5000)
    cos, sin = DeepseekV3RotaryEmbedding(config)(torch.zeros(1), positions[None])
    our_cos, our_sin = _rope_tables(dim, rope["rope_theta"], yarn, 8192, "cpu", torch.float32)
    assert torch.equal(our_cos[:5000], cos[0]) and torch.equal(our_sin[:5000], sin[0]), name
    # Which of the published configs differ from plain rotary where it matters.
    plain = rope_frequencies(dim, rope["rope_theta"], None)
    assert not torch.equal(ours, plain) and torch.equal(ours[:4], plain[:4]), name
    expected_factor = {"deepseek-v3": 1.0, "deepseek-v2-lite": 1.0}.get(
        name, 0.1 * math.log(32) + 1
    )
    assert attention_factor == pytest.approx(expected_factor), name


def test_llama3_scaling_still_equals_hf():
    import transformers
    from transformers.modeling_rope_utils import _compute_llama3_parameters

    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192}  # fmt: skip
    config = transformers.LlamaConfig(hidden_size=512, num_attention_heads=4, rope_parameters=rope)
    inv_freq, factor = _compute_llama3_parameters(config)
    assert torch.equal(rope_frequencies(128, 500000.0, (8.0, 1.0, 4.0, 8192)), inv_freq)
    assert factor == rope_attention_factor((8.0, 1.0, 4.0, 8192)) == 1.0


def _saved_shapes(module, x, recompute: bool) -> tuple[list[tuple], dict]:
    """The shapes of every tensor autograd saved in the module's forward (recompute: the
    core under megacore's checkpoint, as `apply_recompute` wraps it), and the gradients."""
    module.zero_grad()
    module.core_attention = (
        (lambda *a: tp.checkpoint(module.core, False, *a)) if recompute else module.core
    )
    shapes = []

    def pack(t):
        shapes.append(tuple(t.shape))
        return t

    x = x.clone().requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out, _ = module(x)
    out.square().sum().backward()
    grads = {n: p.grad.clone() for n, p in module.named_parameters()}
    return shapes, {**grads, "x": x.grad}


def test_selective_recompute_keeps_the_latent_not_the_keys_and_values(gloo_world_of_one):
    module = _mla(_cfg(12, YARN))
    x = torch.randn(S, B, H, generator=torch.Generator().manual_seed(0))
    kept, grads = _saved_shapes(module, x, recompute=False)
    recomputed, recomputed_grads = _saved_shapes(module, x, recompute=True)
    for name, g in grads.items():
        torch.testing.assert_close(recomputed_grads[name], g, rtol=0, atol=1e-6, msg=name)
    nope, rope, v, heads = 6, 4, 5, HEADS
    # By size, whatever view the kernels save them in ([b, heads, s, d], [b heads, s, d], ...;
    # the values by their width too: the projection's input has their size).
    qk = B * heads * S * (nope + rope)  # a query's or a key's
    values, scores = (B * heads * S * v, v), (B * heads * S * S, S)
    kept = [(math.prod(shape), shape[-1]) for shape in kept]
    saved = [(math.prod(shape), shape[-1]) for shape in recomputed]
    kept_qk, saved_qk = [n for n, _ in kept].count(qk), [n for n, _ in saved].count(qk)
    # Without recompute autograd keeps the keys, the values and the scores (so the checks
    # below can fail) ...
    assert kept_qk >= 2 and values in kept and scores in kept, kept
    # ... with it, the core keeps its inputs: the queries, the latent and the rope key.
    assert saved_qk == 1 and values not in saved and scores not in saved, recomputed
    assert (S, B, 8) in recomputed and (B, 1, S, rope) in recomputed, recomputed


def test_activation_count_is_what_selective_recompute_keeps(gloo_world_of_one, tmp_path):
    """accounting.mla_activations under selective recompute, against what autograd keeps of
    the module's forward (distinct storages; not the parameters, the rotary tables, the
    module's input, which the layer's count holds, or the norms' statistics)."""
    from megatrain.plan.accounting import mla_activations

    config = load_config(None, [*MLA_LLAMA, f"training.output_dir={str(tmp_path)!r}"])
    module = _mla(_cfg(12, YARN))
    module.core_attention = lambda *a: tp.checkpoint(module.core, False, *a)
    x = torch.randn(S, B, H, requires_grad=True)
    skip = {p.untyped_storage().data_ptr() for p in module.parameters()}
    skip.add(x.untyped_storage().data_ptr())
    kept = {}

    def pack(t):
        if t.requires_grad and t.shape[-1] != 1 and t.untyped_storage().data_ptr() not in skip:
            kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes() // t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(x)
    split, unsplit = mla_activations(config, "selective")
    assert sum(kept.values()) == (split + unsplit) * S * B * H / 2  # 16-bit bytes: 2 an element
    assert mla_activations(config, "none")[0] > split


def _gathered(p: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """A parameter's gradient whole: TP shards gathered along their split dimension."""
    if not getattr(p, "tensor_model_parallel", False):
        return grad
    world = ps.get_tensor_model_parallel_world_size()
    parts = [torch.empty_like(grad) for _ in range(world)]
    dist.all_gather(parts, grad.contiguous(), group=ps.get_tensor_model_parallel_group())
    return torch.cat(parts, dim=p.partition_dim)


def _run_module(cfg, x, grad):
    module = _mla(cfg)
    sp, rank = cfg.sequence_parallel, ps.get_tensor_model_parallel_rank()
    world = ps.get_tensor_model_parallel_world_size()
    local = x.chunk(world)[rank] if sp else x
    local = local.clone().requires_grad_()
    out, _ = module(local)
    out.backward(grad.chunk(world)[rank] if sp else grad)
    tp.sync_sequence_parallel_grads(module)
    if sp:  # the sequence gathered back
        outs = [torch.empty_like(out) for _ in range(world)]
        dist.all_gather(outs, out.detach().contiguous(), group=ps.get_tensor_model_parallel_group())
        xs = [torch.empty_like(local) for _ in range(world)]
        dist.all_gather(xs, local.grad, group=ps.get_tensor_model_parallel_group())
        out, x_grad = torch.cat(outs), torch.cat(xs)
    else:
        out, x_grad = out.detach(), local.grad
    grads = {n: _gathered(p, p.grad) for n, p in module.named_parameters()}
    return {"out": out, "x": x_grad, **grads}


def _tensor_parallel_modules():
    x = torch.randn(S, B, H, generator=torch.Generator().manual_seed(0))
    grad = torch.randn(S, B, H, generator=torch.Generator().manual_seed(1))
    diffs = {}
    for q_lora_rank in (12, None):
        ps.initialize_model_parallel(1, 1)
        reference = _run_module(_cfg(q_lora_rank, YARN), x, grad)
        ps.destroy_model_parallel()
        ps.initialize_model_parallel(2, 1)
        for sp in (False, True):
            run = _run_module(_cfg(q_lora_rank, YARN, sequence_parallel=sp), x, grad)
            assert run.keys() == reference.keys()
            diffs[(q_lora_rank, sp)] = {
                k: ((run[k] - reference[k]).abs().max().item(), reference[k].abs().max().item())
                for k in reference
            }
        ps.destroy_model_parallel()
    return diffs


def test_tensor_parallel_mla_equals_one_process():
    diffs = run_distributed(_tensor_parallel_modules, 2, timeout=120)
    for rank_diffs in diffs:
        for case, parts in rank_diffs.items():
            for name, (diff, scale) in parts.items():
                assert scale > 0 and diff <= TOL * max(1.0, scale), (case, name, diff, scale)


# --- training: a tiny Llama with MLA at its layouts against one process -------------------

VOCAB, STEPS, FP32_TOL = 200, 3, 2e-5
# The attention's sizes (test_context_parallel's MLA layout takes them too).
MLA_FIELDS = [
    "model.multi_latent_attention=true",
    "model.q_lora_rank=12",
    "model.kv_lora_rank=8",
    "model.qk_head_dim=6",
    "model.qk_pos_emb_head_dim=4",
    "model.v_head_dim=5",
]
MLA_LLAMA = [
    *TINY_MODEL,
    'model.kind="llama"',
    "model.num_layers=2",
    "model.ffn_hidden_size=48",
    *MLA_FIELDS,
    'model.rope_type="yarn"',
    "model.rotary_scaling_factor=4.0",
    "model.original_max_position_embeddings=8",
    "model.mscale=0.707",
    "model.mscale_all_dim=1.0",
    "model.init_method_std=0.25",  # sharp attention: wrong positions would show in the loss
    *QUIET_LOGGING,
    "training.seq_length=16",
    "training.micro_batch_size=2",
    "training.global_batch_size=8",
    f"training.train_iters={STEPS}",
    f"training.eval_interval={STEPS}",
    "training.eval_iters=1",
    "optimizer.lr=0.003",
    "optimizer.lr_warmup_iters=1",
]
PACKED = ["data.reset_position_ids=true", "data.reset_attention_mask=true"]
TP2_SP = ["parallel.tensor_model_parallel_size=2", "parallel.sequence_parallel=true"]
# The down-projections' gradients straight into main_grad, then summed over TP from there.
LEVERS = [
    "training.gradient_accumulation_fusion=true",
    "training.fused_linear_cross_entropy=true",
    "training.one_sync_per_iteration=true",
]


def cp(comm: str) -> list[str]:
    return ["parallel.context_parallel_size=2", f"parallel.cp_comm_type={comm!r}"]


# DeepSeek-V2-Lite's queries (no query latent) and one MTP depth (an MLA layer of its own).
NO_Q_LORA_MTP = ['model.q_lora_rank="none"', "model.mtp_num_layers=1"]
REFERENCES = {
    "reference": [],
    "packed": PACKED,
    "selective": ['model.recompute="selective"'],
    "no-q-lora-mtp": NO_Q_LORA_MTP,
    "four-layers": ["model.num_layers=4"],  # for interleaving: 2 stages x 2 chunks of a layer
    "four-mtp-packed": ["model.num_layers=4", "model.mtp_num_layers=1", *PACKED],
}
PP2 = ["parallel.pipeline_model_parallel_size=2"]


def uneven(layout: str) -> list[str]:
    """Four layers and an MTP depth on packed documents, at pp 2 split by `layout`."""
    return [*REFERENCES["four-mtp-packed"], *PP2,
            f"parallel.pipeline_model_parallel_layout={layout!r}"]  # fmt: skip


# name: (the one-process run it equals, its overrides); 2 ranks each.
LAYOUTS = {
    "tp2-sp-levers": ("reference", [*TP2_SP, *LEVERS]),
    "tp2-sp-packed": ("packed", [*TP2_SP, *PACKED]),
    "pp2-zb-h1-selective": ("reference", [
        "parallel.pipeline_model_parallel_size=2",
        'parallel.pipeline_schedule="zb-h1"',
        'model.recompute="selective"',
    ]),
    # Context parallelism with each comm type: the fused ring (no documents) and the float32
    # one (documents), the K/V all-gather, and the latent gather (with documents, and with
    # selective recompute keeping the gathered latent).
    "cp2-p2p-no-q-lora-mtp": ("no-q-lora-mtp", [*cp("p2p"), *NO_Q_LORA_MTP]),
    "cp2-p2p-packed": ("packed", [*cp("p2p"), *PACKED]),
    "cp2-allgather-packed": ("packed", [*cp("allgather"), *PACKED]),
    "cp2-latent": ("reference", cp("latent")),
    "cp2-latent-no-q-lora-mtp": ("no-q-lora-mtp", [*cp("latent"), *NO_Q_LORA_MTP]),
    "cp2-latent-packed-selective": (
        "packed", [*cp("latent"), *PACKED, 'model.recompute="selective"']),
    # 1F1B with the MTP depth on the last stage, data parallelism with the distributed
    # optimizer and fully sharded (FSDP2), the MTP depth's latent layer sharded too.
    "pp2-1f1b-no-q-lora-mtp": ("no-q-lora-mtp", [
        *PP2, 'parallel.pipeline_schedule="1f1b"', *NO_Q_LORA_MTP,
    ]),
    "pp2-interleaved-four-layers": ("four-layers", [
        "model.num_layers=4", *PP2, "parallel.virtual_pipeline_model_parallel_size=2"]),
    "dp2-distopt-packed": ("packed", ["parallel.use_distributed_optimizer=true", *PACKED]),
    "dp2-fsdp-no-q-lora-mtp": (
        "no-q-lora-mtp", ['parallel.data_parallel_sharding="full"', *NO_Q_LORA_MTP]),
    # Uneven stages (parallel.pipeline_model_parallel_layout): 3 + 1 layers under 1F1B; 1 + 3
    # under ZB-H1; interleaved with a last chunk of no transformer layer (the MTP depth, the
    # final norm, the output layer and the loss), and with a middle chunk of none (it passes
    # its input on; also fully sharded, where that chunk has no parameter to shard).
    "pp2-uneven-1f1b": ("four-mtp-packed", uneven("Et*3|tmL")),
    "pp2-uneven-zb-h1": ("four-mtp-packed", [
        *uneven("Et|tttmL"), 'parallel.pipeline_schedule="zb-h1"']),
    "pp2-vpp2-uneven-empty-last": ("four-mtp-packed", [
        *uneven("Et|tt|t|mL"), "parallel.virtual_pipeline_model_parallel_size=2"]),
    "pp2-vpp2-uneven-empty-middle": ("four-mtp-packed", [
        *uneven("Ett||t|tmL"), "parallel.virtual_pipeline_model_parallel_size=2"]),
    "pp2-vpp2-uneven-empty-middle-fsdp": ("four-mtp-packed", [
        *uneven("Ett||t|tmL"), "parallel.virtual_pipeline_model_parallel_size=2",
        'parallel.data_parallel_sharding="full"']),
}  # fmt: skip
# What each rank of an uneven layout builds: its chunks' (layer ids, holds the MTP depth).
EMPTY_MIDDLE = ([([0, 1], False), ([2], False)], [([], False), ([3], True)])
UNEVEN_CHUNKS = {
    "pp2-uneven-1f1b": ([([0, 1, 2], False)], [([3], True)]),
    "pp2-uneven-zb-h1": ([([0], False)], [([1, 2, 3], True)]),
    "pp2-vpp2-uneven-empty-last": ([([0], False), ([3], False)], [([1, 2], False), ([], True)]),
    "pp2-vpp2-uneven-empty-middle": EMPTY_MIDDLE,
    "pp2-vpp2-uneven-empty-middle-fsdp": EMPTY_MIDDLE,
}


def _train_config(corpus, out, overrides=()):
    return load_config(
        None, [f"data.corpus={corpus!r}", f"training.output_dir={out!r}", *MLA_LLAMA, *overrides]
    )


def _train(corpus, out, runs: dict):
    """Each run's history (rank 0), and on every rank the chunks it built: (layer ids,
    whether it holds the MTP depths) each."""
    from megatrain.run import setup
    from megatrain.run.loop import train

    build, built = setup.build_model_chunks, []

    def recorded(*args, **kw):
        chunks = build(*args, **kw)
        built[:] = [(c.layer_ids, getattr(c, "mtp", None) is not None) for c in chunks]
        return chunks

    setup.build_model_chunks, results = recorded, {}
    try:
        for name, overrides in runs.items():
            history = train(_train_config(corpus, f"{out}/{name}", overrides)) or {}
            results[name] = {**history, "chunks": list(built)}
    finally:
        setup.build_model_chunks = build
    return results


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    from megatrain.testing import write_counting_corpus

    return str(write_counting_corpus(tmp_path_factory.mktemp("corpus"), VOCAB))


def test_mla_llama_layouts_take_the_one_process_steps(corpus, tmp_path):
    from megatrain.checkpoint.files import find_checkpoint, read_meta
    from megatrain.inference.load import check_layout
    from megatrain.testing import assert_same_steps

    one = run_distributed(_train, 1, args=(corpus, str(tmp_path / "one"), REFERENCES))[0]
    runs = {name: overrides for name, (_, overrides) in LAYOUTS.items()}
    # A checkpoint of uneven pp 2 (3 + 1 layers, two steps) goes on at tp 2 + sp and takes
    # the reference's third.
    ckpt = str(tmp_path / "ckpt")
    runs["first"] = [*uneven("Et*3|tmL"), "training.exit_interval=2", f"checkpoint.save={ckpt!r}"]
    runs["at-tp2"] = [*REFERENCES["four-mtp-packed"], *TP2_SP, f"checkpoint.load={ckpt!r}"]
    two = run_distributed(_train, 2, args=(corpus, str(tmp_path / "two"), runs), timeout=300)
    reference = one["reference"]
    assert all(math.isfinite(x) for x in reference["loss"])
    assert reference["loss"][-1] < reference["loss"][0]
    assert one["packed"]["loss"] != reference["loss"]  # the documents changed the attention
    mtp = one["no-q-lora-mtp"]["mtp_loss/depth1"]
    assert len(mtp) == STEPS and all(math.isfinite(x) for x in mtp)
    assert_same_steps(one["selective"], reference, "selective", FP32_TOL)
    for name, (expected, _) in LAYOUTS.items():
        run, ref = two[0][name], one[expected]
        assert len(run["loss"]) == STEPS, name
        assert_same_steps(run, ref, name, FP32_TOL)
        for a, b in zip(
            run.get("mtp_loss/depth1", []), ref.get("mtp_loss/depth1", []), strict=True
        ):
            assert abs(a - b) < FP32_TOL, (name, run["mtp_loss/depth1"], ref["mtp_loss/depth1"])
    for name, ranks in UNEVEN_CHUNKS.items():  # the layout's layers, not the even split's
        assert tuple([tuple(c) for c in two[r][name]["chunks"]] for r in (0, 1)) == ranks, name
    first, then = two[0]["first"], two[0]["at-tp2"]
    assert first["stopped_at"] == 2 and len(then["loss"]) == STEPS - 2
    fields = ("loss", "grad_norm", "mtp_loss/depth1")
    steps = {k: first[k] + then[k] for k in fields} | {"valid": then["valid"]}
    reference = one["four-mtp-packed"]
    assert_same_steps(steps, reference, "uneven pp2 -> tp2 + sp", FP32_TOL)
    mtp = zip(steps["mtp_loss/depth1"], reference["mtp_loss/depth1"], strict=True)
    assert max(abs(a - b) for a, b in mtp) < FP32_TOL, (steps, reference)
    # Forward passes from it (generate, megaeval, convert, export) split the layers evenly
    # over their own pp: the saved layout is the training run's stages.
    meta = read_meta(find_checkpoint(ckpt))
    assert meta["config"]["parallel"]["pipeline_model_parallel_layout"] == "Et*3|tmL"
    assert check_layout(meta, 1, 1, Path(ckpt)).parallel.pipeline_model_parallel_layout is None


# --- refusals and accounting --------------------------------------------------------------


def _refused(tmp_path, overrides: list[str]) -> str:
    config = load_config(None, [*MLA_LLAMA, *overrides, f"training.output_dir={str(tmp_path)!r}"])
    with pytest.raises(ConfigError) as err:
        validate(config, world_size=4)
    return str(err.value)


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        (['model.kind="bert"', 'model.position_embedding_type="rope"'], "model.kind"),
        (["model.qk_pos_emb_head_dim=5"], "model.qk_pos_emb_head_dim"),
        (["model.num_attention_heads=3"], "model.num_attention_heads"),
        (["model.num_attention_heads=2", "parallel.tensor_model_parallel_size=4"],
         "parallel.tensor_model_parallel_size"),
        (['model.position_embedding_type="learned_absolute"'], "model.position_embedding_type"),
        (["model.num_query_groups=2"], "model.num_query_groups"),
        (["model.rope_scaling_factor=8.0"], "model.rope_scaling_factor"),
        (["model.beta_fast=0.5"], "model.beta_fast"),
        (["model.rotary_scaling_factor=0.5"], "model.rotary_scaling_factor"),
    ],
)  # fmt: skip
def test_bad_mla_and_yarn_configs_are_refused_naming_the_field(tmp_path, overrides, named):
    assert named in _refused(tmp_path, overrides)


@pytest.mark.parametrize("comm", ["p2p", "allgather", "latent"])
def test_mla_takes_context_parallelism_with_each_comm_type(tmp_path, comm):
    config = load_config(None, [*MLA_LLAMA, *cp(comm), f"training.output_dir={str(tmp_path)!r}"])
    validate(config, world_size=4)  # the refusal of "latent" without MLA: test_context_parallel


# DeepSeek-V2-Lite's published config.json (the fields the attention and the count read).
V2_LITE = dict(
    vocab_size=102400, hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408,
    num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16, n_shared_experts=2,
    n_routed_experts=64, num_experts_per_tok=6, first_k_dense_replace=1, kv_lora_rank=512,
    q_lora_rank=None, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
    max_position_embeddings=163840, tie_word_embeddings=False, topk_method="greedy",
)  # fmt: skip


def _v2_lite_ours(**kw) -> TransformerConfig:
    c = {**V2_LITE, **kw}
    return TransformerConfig(
        num_layers=c["num_hidden_layers"], hidden_size=c["hidden_size"],
        num_attention_heads=c["num_attention_heads"], vocab_size=c["vocab_size"],
        max_position_embeddings=c["max_position_embeddings"],
        ffn_hidden_size=c["intermediate_size"], normalization="rmsnorm",
        position_embedding="rope", swiglu=True, add_bias=False, tie_output=False,
        attention_type="mla", q_lora_rank=c["q_lora_rank"], kv_lora_rank=c["kv_lora_rank"],
        qk_head_dim=c["qk_nope_head_dim"], qk_pos_emb_head_dim=c["qk_rope_head_dim"],
        v_head_dim=c["v_head_dim"], num_moe_experts=c["n_routed_experts"],
        moe_router_topk=c["num_experts_per_tok"], moe_ffn_hidden_size=c["moe_intermediate_size"],
        moe_shared_expert_intermediate_size=c["n_shared_experts"] * c["moe_intermediate_size"],
        moe_layer_freq=[0] * c["first_k_dense_replace"]
        + [1] * (c["num_hidden_layers"] - c["first_k_dense_replace"]),
    )  # fmt: skip


def test_accounting_counts_deepseek_v2_lite_as_hf_builds_it():
    import transformers
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2Attention

    from megatrain.plan import accounting as acc

    hf_config = transformers.DeepseekV2Config(**V2_LITE)
    with torch.device("meta"):
        attention = DeepseekV2Attention(hf_config, 0)
        model = transformers.DeepseekV2ForCausalLM(hf_config)
    cfg = _v2_lite_ours()
    assert acc.attention_parameters(cfg) == sum(p.numel() for p in attention.parameters())
    total = sum(p.numel() for p in model.parameters())
    assert acc.gpt_parameters(cfg) == total
    # DeepSeek's published 15.7B total and 2.4B activated, which leaves out the word
    # embedding (a lookup: 0.21B) and truncates 2.45B.
    assert round(total / 1e9, 1) == 15.7
    embedding = V2_LITE["vocab_size"] * V2_LITE["hidden_size"]
    assert 2.4e9 <= acc.active_parameters(cfg) - embedding < 2.5e9
    # One TP rank's share: the heads' projections split, the down-projections and norms whole.
    h, heads = 2048, 16
    split = h * heads * 192 + 512 * heads * 256 + heads * 128 * h
    replicated = h * 576 + 512
    assert acc.attention_parameters_per_rank(cfg, 4) == split // 4 + replicated
    assert acc.parameters_per_gpu(cfg) == total


def _v3_ours(layers: int) -> TransformerConfig:
    """DeepSeek-V3's published shape (HF DeepseekV3Config's defaults) at `layers` layers, the
    first 3 dense."""
    return TransformerConfig(
        num_layers=layers, hidden_size=7168, num_attention_heads=128, vocab_size=129280,
        max_position_embeddings=163840, ffn_hidden_size=18432, normalization="rmsnorm",
        position_embedding="rope", swiglu=True, add_bias=False, tie_output=False,
        attention_type="mla", q_lora_rank=1536, kv_lora_rank=512, qk_head_dim=128,
        qk_pos_emb_head_dim=64, v_head_dim=128, num_moe_experts=256, moe_router_topk=8,
        moe_ffn_hidden_size=2048, moe_shared_expert_intermediate_size=2048,
        moe_layer_freq=[0] * 3 + [1] * (layers - 3),
    )  # fmt: skip


def test_accounting_counts_deepseek_v3_as_hf_builds_it():
    """The query latent's path at DeepSeek-V3's size: HF's model (4 layers, on the meta
    device: 3 dense and one MoE) counted alike, and the 61 layers' 671B total (HF's full
    model, counted once by hand: 671,026,404,352) with 37B activated (less the word
    embedding, as DeepSeek counts: 36.6B)."""
    import transformers

    from megatrain.plan import accounting as acc

    with torch.device("meta"):
        model = transformers.DeepseekV3ForCausalLM(
            transformers.DeepseekV3Config(num_hidden_layers=4)
        )
    assert acc.gpt_parameters(_v3_ours(4)) == sum(p.numel() for p in model.parameters())
    cfg = _v3_ours(61)
    assert acc.gpt_parameters(cfg) == 671_026_404_352
    assert round((acc.active_parameters(cfg) - 129280 * 7168) / 1e9) == 37


def test_mla_flops_are_megatrons_formula():
    """Megatron-LM's `num_floating_point_operations` MLA terms (per layer and token, forward
    x 2 for the multiply-add), less its norms' r terms (not matmuls here, as for every other
    kind), and the attention core over the full s x s as this project's MFU counts it."""
    from megatrain.plan import accounting as acc

    for q_lora_rank in (None, 1536):
        cfg = _v2_lite_ours(q_lora_rank=q_lora_rank, first_k_dense_replace=27)  # all dense
        h, a, dn, dr, dv, r = 2048, 16, 128, 64, 128, 512
        q = h * a * (dn + dr) if q_lora_rank is None else q_lora_rank * (h + a * (dn + dr))
        attention = q + r * (h + a * (dn + dv)) + h * dr + a * dv * h
        mlp = 3 * h * 10944
        b, s, n = 2, 4096, cfg.num_layers
        dense, core = acc.transformer_forward_flops(cfg, b, s)
        assert dense == 2 * b * s * n * (attention + mlp)
        assert core == 2 * b * s * s * n * a * (dn + dr + dv)
