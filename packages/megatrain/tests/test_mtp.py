"""Multi-token prediction (DeepSeek-V3's MTP, `models.mtp`).

- `mtp_targets`: each depth's shifted tokens, targets and mask against a loop over positions
  (the end of the sequence, packed documents, EOD-masked targets).
- The model's per-depth losses equal the formula written out from its weights (embedding
  first in the concatenation, the depth before's normed states, each depth's own norm, the
  shared output layer); the other order gives other losses.
- The normalisation is the microbatch's count of kept targets at every layout (4 gloo ranks,
  cp 2 x dp 2, packed documents with EOD masking, uneven counts over the CP and the DP
  ranks): every parameter's gradient equals one process's, and the logged losses; a rank's
  own count in its place (Megatron-LM's MTP under CP) gives other gradients.
- Real gloo groups, the training loop against one process (losses, each depth's loss, grad
  norms, validation loss and each depth's validation loss, the MoE aux loss): tp 2 + sp, pp 2
  (1F1B; ZB-H1 with full recompute), cp 2 (p2p) with packed documents, cp 2 (all-gather)
  with selective recompute, dp 2 with the distributed optimizer and packed documents, FSDP,
  ep 2 with MoE depths, GPT-2 (tied embeddings) at pp 2 interleaved; a pp 2 checkpoint goes
  on at tp 2 + sp.
- Refusals before any worker starts, naming the field.
- Accounting: the parameters against the built model (whole, per pp stage), DeepSeek-V3's
  MTP layer against HF's, the FLOPs of the depths.
- `generate --speculative mtp`: plain greedy's tokens whatever the drafts, and at tp 1 and 2
  through the command, with the drafts' acceptance.
"""

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megacore import parallel_state as ps
from megacore.testing import run_distributed
from megatrain.config import ConfigError, load_config, validate
from megatrain.models.gpt import GPTModel
from megatrain.models.layout import ParallelContext
from megatrain.models.mtp import mtp_targets
from megatrain.models.transformer_config import TransformerConfig
from megatrain.testing import TINY_MODEL, short_run

VOCAB, STEPS, FP32_TOL = 200, 3, 2e-5


# --- the shifted targets ------------------------------------------------------------------


def _packed_batch(seed: int, b: int = 2, s: int = 12) -> dict:
    """Random tokens with EODs (id 0) in them: documents, positions and the EOD loss mask as
    `data.document_arrays` makes them."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, VOCAB, (b, s + 1), generator=g)
    tokens[tokens % 5 == 0] = 0  # EODs, unevenly placed
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    is_eod = inputs == 0
    segments = torch.zeros_like(inputs)
    segments[:, 1:] = is_eod[:, :-1].cumsum(1)
    starts = torch.cat([torch.zeros(b, 1, dtype=torch.bool), is_eod[:, :-1]], 1)
    index = torch.arange(s).expand(b, s)
    first = torch.cummax(torch.where(starts, index, torch.zeros_like(index)), 1).values
    return {
        "tokens": inputs.contiguous(),
        "labels": labels.contiguous(),
        "position_ids": index - first,
        "segments": segments,
        "loss_mask": (~is_eod).float(),
    }


def test_mtp_targets_shift_within_the_sequence_and_the_document():
    batch = _packed_batch(0)
    depth = 3
    out = mtp_targets(batch, depth)
    b, s = batch["tokens"].shape
    assert out["mtp_tokens"].shape == out["mtp_labels"].shape == out["mtp_mask"].shape
    assert out["mtp_mask"].shape == (b, s, depth)
    seen = {"document": 0, "end": 0, "eod": 0}
    for r in range(b):
        for i in range(s):
            for k in range(1, depth + 1):
                j = i + k
                if j >= s:
                    seen["end"] += 1
                    assert out["mtp_mask"][r, i, k - 1] == 0
                    continue
                assert out["mtp_tokens"][r, i, k - 1] == batch["tokens"][r, j]
                assert out["mtp_labels"][r, i, k - 1] == batch["labels"][r, j]
                other = batch["segments"][r, j] != batch["segments"][r, i]
                eod = batch["loss_mask"][r, j] == 0
                seen["document"] += int(bool(other))
                seen["eod"] += int(bool(eod) and not other)
                assert out["mtp_mask"][r, i, k - 1] == float(not (other or eod)), (r, i, k)
    assert all(seen.values()), seen  # every reason to mask a target occurred
    plain = mtp_targets({"tokens": batch["tokens"], "labels": batch["labels"]}, depth)
    assert plain["mtp_mask"][:, : s - depth].eq(1).all()  # no documents: the end alone


# --- the formula ----------------------------------------------------------------------------


def _cfg(**kw) -> TransformerConfig:
    base = dict(
        num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=VOCAB,
        max_position_embeddings=64, hidden_dropout=0.0, attention_dropout=0.0,
        normalization="rmsnorm", position_embedding="rope", swiglu=True, add_bias=False,
        tie_output=False, ffn_hidden_size=48, init_method_std=0.1, mtp_num_layers=2,
    )  # fmt: skip
    return TransformerConfig(**{**base, **kw})


def _written_out(model: GPTModel, batch: dict, embedding_first: bool = True) -> torch.Tensor:
    """Each depth's loss per token from the model's weights, the formula written out."""
    h = model.run_layers(model.embed(batch["tokens"]))  # after the final norm: h^0
    losses = []
    for k, depth in enumerate(model.mtp.layers.values()):
        e = F.embedding(batch["mtp_tokens"][..., k], model.embedding.weight).transpose(0, 1)
        parts = [depth.enorm(e), depth.hnorm(h)]
        joined = torch.cat(parts if embedding_first else parts[::-1], -1)
        h = depth.final_layernorm(depth.layer(F.linear(joined, depth.eh_proj.weight)))
        logits = F.linear(h, model.output_layer.weight)  # the shared output layer
        target = batch["mtp_labels"][..., k].t()
        losses.append(F.cross_entropy(logits.flatten(0, 1), target.flatten(), reduction="none"))
        losses[-1] = losses[-1].view_as(target).t()
    return torch.stack(losses, -1)


@pytest.mark.parametrize("tied", [False, True])
def test_mtp_losses_are_the_formula(gloo_world_of_one, tied):
    cfg = _cfg(tie_output=tied, **({"normalization": "layernorm"} if tied else {}))
    model = GPTModel(cfg, seed=7, parallel=ParallelContext())
    if tied:
        model.output_layer.weight = model.embedding.weight  # the written-out form reads it
    batch = mtp_targets(_packed_batch(3, s=10), 2)
    args = {k: batch[k] for k in ("mtp_tokens", "mtp_labels")}
    out = model(batch["tokens"], batch["labels"], **args)
    assert set(out) == {"lm", "mtp"} and out["mtp"].shape == (2, 10, 2)
    with torch.no_grad():
        expected = _written_out(model, batch)
        swapped = _written_out(model, batch, embedding_first=False)
    torch.testing.assert_close(out["mtp"], expected, rtol=1e-5, atol=1e-5)
    assert (swapped - expected).abs().max() > 1e-2  # the order is seen
    lm = model(batch["tokens"], batch["labels"])  # without the depths' inputs: the LM loss
    torch.testing.assert_close(lm, out["lm"])
    # Every MTP parameter learns from the depths' losses (and only theirs).
    out["mtp"].sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.mtp.parameters())


def test_mtp_layer_takes_the_kind_of_its_position(gloo_world_of_one):
    moe = dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=16)
    # Every other layer MoE: position num_layers = 2 is one; a 0/1 list: the last layer's kind.
    every_other = GPTModel(_cfg(moe_layer_freq=2, **moe), parallel=ParallelContext())
    dense_last = GPTModel(_cfg(moe_layer_freq=[1, 0], **moe), parallel=ParallelContext())
    kinds = [
        [type(d.layer.mlp).__name__ for d in m.mtp.layers.values()]
        for m in (every_other, dense_last)
    ]
    assert kinds == [["MoELayer", "ParallelMLP"], ["ParallelMLP", "ParallelMLP"]]


# --- the normalisation at cp 2 x dp 2 ---------------------------------------------------------

SCALE = 0.3


def _grads(model) -> dict:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _documents_and_depths(batch: dict) -> dict:
    keys = ("position_ids", "segments", "mtp_tokens", "mtp_labels")
    return {k: batch[k] for k in keys}


def _normalisation_rank(seq: int):
    from megatrain.parallelize import apply_context_parallel, split_batch_for_context_parallel
    from megatrain.run.step import _forward_step, gpt_loss

    ps.initialize_model_parallel(1, 1, context_parallel_size=2)
    dp, cp = ps.get_data_parallel_rank(), ps.get_context_parallel_rank()
    group = ps.get_data_parallel_group(with_context_parallel=True)
    micro = [mtp_targets(_packed_batch(10 + i, s=seq), 2) for i in range(2)]
    cfg = _cfg()
    names = ("loss", "mtp_loss/depth1", "mtp_loss/depth2")

    def built():
        return GPTModel(cfg, seed=5, parallel=ParallelContext())

    def mean_over_layout(grads: dict) -> dict:  # the DDP's mean over dp x cp
        for g in grads.values():
            dist.all_reduce(g, group=group)
            g /= 4
        return grads

    # One process: both microbatches, each its own mean, the gradients accumulated / 2.
    one, logged_one = built(), []
    for batch in micro:
        out = one(batch["tokens"], batch["labels"], **_documents_and_depths(batch))
        loss, stats = gpt_loss(batch["loss_mask"], batch["mtp_mask"], SCALE, 1, out)
        (loss / 2).backward()
        logged_one.append(torch.stack([stats[n] for n in names]))
    # This rank: its DP rank's microbatch, its CP part, as the train step runs it.
    model = apply_context_parallel(built(), "p2p")
    output, loss_func = _forward_step(iter([micro[dp]]), model, mtp_loss_scale=SCALE)
    loss, stats = loss_func(output)
    loss.backward()
    logged = torch.stack([stats[n] for n in names])
    dist.all_reduce(logged, group=group)
    # Megatron-LM's MTP under CP: the LM loss as ours, each depth over the rank's own count.
    local = apply_context_parallel(built(), "p2p")
    part = split_batch_for_context_parallel(micro[dp], cp, 2)
    out = local(part["tokens"], part["labels"], **_documents_and_depths(part))
    lm, _ = gpt_loss(part["loss_mask"], None, 0.0, 2, out["lm"])
    masks = part["mtp_mask"].unbind(-1)
    own = [(out["mtp"][..., k] * m).sum() / m.sum() for k, m in enumerate(masks)]
    (lm + SCALE / 2 * sum(own)).backward()
    counts = torch.stack([m.sum() for m in masks])
    all_counts = [torch.zeros_like(counts) for _ in range(4)]
    dist.all_gather(all_counts, counts, group=group)
    return {
        "reference": _grads(one),
        "grads": mean_over_layout(_grads(model)),
        "local": mean_over_layout(_grads(local)),
        "logged": logged / 4,
        "reference_logged": sum(logged_one) / 2,
        "counts": torch.stack(all_counts),
    }


def test_mtp_loss_is_normalised_by_the_microbatch_count_at_cp2_dp2():
    results = run_distributed(_normalisation_rank, 4, args=(16,), timeout=300)
    for rank, r in enumerate(results):
        assert len(set(map(tuple, r["counts"].tolist()))) > 1, r["counts"]  # uneven counts
        assert r["grads"].keys() == r["reference"].keys()
        assert any(n.startswith("mtp.") for n in r["grads"])
        for name, g in r["grads"].items():
            torch.testing.assert_close(g, r["reference"][name], rtol=1e-5, atol=1e-6, msg=name)
        torch.testing.assert_close(r["logged"], r["reference_logged"], rtol=1e-5, atol=1e-6)
        worst = max((r["local"][n] - r["reference"][n]).abs().max() for n in r["reference"])
        assert worst > 1e-4, (rank, worst)  # a rank's own count gives other gradients


# --- training at the layouts against one process ----------------------------------------------

MTP_LLAMA = [
    *TINY_MODEL,
    'model.kind="llama"',
    "model.num_layers=2",
    "model.ffn_hidden_size=48",
    "model.mtp_num_layers=2",
    "model.mtp_loss_scaling_factor=0.5",
    "model.init_method_std=0.25",  # sharp attention: wrong positions would show in the loss
    *short_run(STEPS),
]
PACKED = [
    "data.reset_position_ids=true",
    "data.reset_attention_mask=true",
    "data.eod_mask_loss=true",
]
MOE = [
    "model.num_moe_experts=4",
    "model.moe_router_topk=2",
    "model.moe_ffn_hidden_size=16",
    'model.moe_router_load_balancing_type="aux_loss"',
    "model.moe_aux_loss_coeff=0.01",
]
GPT = ['model.kind="gpt"', "model.num_layers=4"]  # tied: the last stage's copy serves both
REFERENCES = {"reference": [], "packed": PACKED, "moe": MOE, "gpt": GPT}
PP2 = ["parallel.pipeline_model_parallel_size=2"]
# name: (the one-process run it equals, its overrides)
LAYOUTS = {
    "tp2-sp": (
        "reference",
        ["parallel.tensor_model_parallel_size=2", "parallel.sequence_parallel=true"],
    ),
    "pp2-1f1b": ("reference", [*PP2, 'parallel.pipeline_schedule="1f1b"']),
    "pp2-zb-h1-full-recompute": (
        "reference",
        [*PP2, 'parallel.pipeline_schedule="zb-h1"', 'model.recompute="full"'],
    ),
    "cp2-p2p-packed": (
        "packed",
        ["parallel.context_parallel_size=2", 'parallel.cp_comm_type="p2p"', *PACKED],
    ),
    "dp2-distopt-packed": ("packed", ["parallel.use_distributed_optimizer=true", *PACKED]),
    "dp2-fsdp": ("reference", ['parallel.data_parallel_sharding="full"']),
    "cp2-allgather-selective": (
        "reference",
        [
            "parallel.context_parallel_size=2",
            'parallel.cp_comm_type="allgather"',
            'model.recompute="selective"',
        ],
    ),
    "ep2": ("moe", [*MOE, "parallel.expert_model_parallel_size=2"]),
    "gpt-pp2-interleaved": ("gpt", [*GPT, *PP2, "parallel.virtual_pipeline_model_parallel_size=2"]),
}
DEPTHS = ("mtp_loss/depth1", "mtp_loss/depth2")


def _train_config(corpus, out, overrides=()):
    return load_config(
        None, [f"data.corpus={corpus!r}", f"training.output_dir={out!r}", *MTP_LLAMA, *overrides]
    )


def _train(corpus, out, runs: dict):
    from megatrain.run.loop import train

    results = {}
    for name, overrides in runs.items():
        history = train(_train_config(corpus, f"{out}/{name}", overrides))
        if history is not None:  # rank 0: the aux and validation's per-depth losses, its log
            lines = Path(f"{out}/{name}/log.jsonl").read_text().splitlines()
            log = [json.loads(line) for line in lines]
            valid = [r for r in log if "valid_loss" in r][-1:]  # none: stopped before it
            history["valid_mtp"] = [v[f"valid_{d}"] for v in valid for d in DEPTHS]
            history["aux"] = [r["moe_aux_loss"] for r in log if "moe_aux_loss" in r]
        results[name] = history
    return results


def _layouts(corpus, out):
    runs = {name: overrides for name, (_, overrides) in LAYOUTS.items()}
    # A checkpoint of pp 2 (the last stage's copy of the untied word embeddings, for MTP,
    # not saved) goes on at tp 2 + sp.
    ckpt = f"{out}/ckpt"
    runs["first"] = [*PP2, "training.exit_interval=2", f"checkpoint.save={ckpt!r}"]
    runs["at-tp2"] = [*LAYOUTS["tp2-sp"][1], f"checkpoint.load={ckpt!r}"]
    return _train(corpus, out, runs)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    from megatrain.testing import write_counting_corpus

    return str(write_counting_corpus(tmp_path_factory.mktemp("corpus"), VOCAB))


@pytest.fixture(scope="module")
def references(corpus, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("mtp-one"))
    return run_distributed(_train, 1, args=(corpus, out, REFERENCES), timeout=600)[0]


@pytest.fixture(scope="module")
def layouts(corpus, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("mtp-layouts"))
    return run_distributed(_layouts, 2, args=(corpus, out), timeout=1500)[0]


def _same_mtp(run: dict, reference: dict, name: str) -> None:
    for depth in DEPTHS:
        for a, b in zip(run[depth], reference[depth], strict=True):
            assert abs(a - b) < FP32_TOL, (name, depth, run[depth], reference[depth])
    for a, b in zip(run["valid_mtp"], reference["valid_mtp"], strict=True):
        assert abs(a - b) < FP32_TOL, (name, run["valid_mtp"], reference["valid_mtp"])


def test_mtp_layouts_take_the_one_process_steps(references, layouts):
    from megatrain.testing import assert_same_steps

    reference = references["reference"]
    assert all(len(reference[d]) == STEPS for d in DEPTHS)
    assert all(math.isfinite(x) for d in ("loss", *DEPTHS) for x in reference[d])
    for control in ("packed", "moe", "gpt"):  # each changes what the depths compute
        assert references[control]["mtp_loss/depth2"] != reference["mtp_loss/depth2"], control
    assert len(references["moe"]["aux"]) == STEPS
    for name, (expected, _) in LAYOUTS.items():
        assert_same_steps(layouts[name], references[expected], name, FP32_TOL)
        _same_mtp(layouts[name], references[expected], name)
        for a, b in zip(layouts[name]["aux"], references[expected]["aux"], strict=True):
            assert abs(a - b) < FP32_TOL, (name, layouts[name]["aux"])


def test_a_pp2_checkpoint_with_mtp_goes_on_at_tp2(references, layouts):
    from megatrain.testing import assert_same_steps

    first, run = layouts["first"], layouts["at-tp2"]
    assert first["stopped_at"] == 2 and len(run["loss"]) == 1
    steps = {k: first[k] + run[k] for k in ("loss", "grad_norm", *DEPTHS)}
    steps |= {"valid": run["valid"], "valid_mtp": run["valid_mtp"]}
    assert_same_steps(steps, references["reference"], "pp2 -> tp2", FP32_TOL)
    _same_mtp(steps, references["reference"], "pp2 -> tp2")


# --- refusals ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        (["model.mtp_num_layers=16"], "model.mtp_num_layers = 16 with training.seq_length = 16"),
        (["model.mtp_num_layers=0"], "model.mtp_num_layers must be > 0, got 0"),
        (['model.kind="bert"'], "model.mtp_num_layers with model.kind = 'bert'"),
        (["model.mtp_loss_scaling_factor=-0.1"], "model.mtp_loss_scaling_factor must be >= 0"),
        (["training.fused_linear_cross_entropy=true"],
         "model.mtp_num_layers with training.fused_linear_cross_entropy = true"),
    ],
)  # fmt: skip
def test_bad_mtp_configs_are_refused_before_workers_start(corpus, monkeypatch, overrides, named):
    from click.testing import CliRunner

    from megatrain.cli import main
    from megatrain.run import launch

    def no_launch(*args, **kwargs):
        raise AssertionError("workers were started for a config that cannot run")

    monkeypatch.setattr(launch, "launch", no_launch)
    config = load_config(None, [*MTP_LLAMA, *overrides])
    with pytest.raises(ConfigError, match=r"model\.mtp"):
        validate(config, world_size=1)
    tiny = Path(__file__).resolve().parents[3] / "pipelines" / "models" / "gpt2-tiny.toml"
    args = ["run", "--config", str(tiny), f"data.corpus={corpus!r}", *MTP_LLAMA, *overrides]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2, result.output
    assert named in result.output, result.output


# --- accounting ---------------------------------------------------------------------------------


def _numel(module) -> int:
    return sum(p.numel() for p in module.parameters())


def test_mtp_parameters_are_the_built_models(gloo_world_of_one):
    from megatrain.plan import accounting as acc

    moe = dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=16)
    for cfg in (_cfg(), _cfg(moe_layer_freq=2, **moe), _cfg(tie_output=True)):
        whole = GPTModel(cfg, parallel=ParallelContext())
        assert acc.gpt_parameters(cfg) == _numel(whole) == acc.parameters_per_gpu(cfg)
        assert acc.mtp_parameters(cfg) == _numel(whole.mtp)
        plain = replace(cfg, mtp_num_layers=None)
        assert acc.active_parameters(cfg) == acc.active_parameters(plain)  # MTP left out
        # pp 2: the depths, and (untied) the word embeddings' copy, on the last stage.
        for stage in (0, 1):
            place = ParallelContext(pp_rank=stage, pp_size=2)
            chunk = GPTModel(cfg, [stage], stage == 0, stage == 1, parallel=place)
            assert acc.parameters_per_gpu(cfg, pp=2, stage=stage) == _numel(chunk), (cfg, stage)
            experts = sum(p.numel() for n, p in chunk.named_parameters() if "experts." in n)
            assert acc.expert_parameters_per_gpu(cfg, pp=2, stage=stage) == experts


def test_deepseek_v3_mtp_layer_counts_as_hf_builds_it():
    """DeepSeek-V3's MTP layer (model.layers.61) is HF's decoder layer 61 (MoE) with eh_proj
    and three norms; the files' 685B (671B + "14B") also hold its copies of the word
    embeddings and the output layer, which MTP shares here: 684.5B with them."""
    import transformers
    from test_multi_latent_attention import _v3_ours
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer

    from megatrain.plan import accounting as acc

    with torch.device("meta"):
        layer = DeepseekV3DecoderLayer(transformers.DeepseekV3Config(), 61)
    h, vocab = 7168, 129280
    cfg = replace(_v3_ours(61), mtp_num_layers=1)
    assert acc.mtp_parameters(cfg) == _numel(layer) + 2 * h * h + 3 * h
    assert acc.gpt_parameters(cfg) == 671_026_404_352 + acc.mtp_parameters(cfg)
    files = acc.gpt_parameters(cfg) + 2 * vocab * h
    assert 684.4e9 < files < 684.5e9
    assert round((acc.active_parameters(cfg) - vocab * h) / 1e9) == 37


def test_mtp_flops_count_each_depth_as_a_layer_and_a_head():
    from megatrain.plan import accounting as acc

    b, s = 2, 64
    moe = dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=16, moe_layer_freq=2)
    for extra in ({}, moe):
        cfg = _cfg(**extra)
        plain = replace(cfg, mtp_num_layers=None)
        # Positions 2 and 3: a layer of each kind when every other layer is MoE.
        layers = replace(plain, num_layers=4)
        h, v = cfg.hidden_size, cfg.vocab_size
        heads = 2 * (2 * b * s * h * v + 2 * b * s * 2 * h * h)
        per_layer = [x - y for x, y in zip(
            acc.transformer_forward_flops(layers, b, s), acc.transformer_forward_flops(plain, b, s),
            strict=True)]  # fmt: skip
        delta = acc.gpt_model_flops_per_iteration(cfg, b, s)
        delta -= acc.gpt_model_flops_per_iteration(plain, b, s)
        assert delta == 3 * (sum(per_layer) + heads)
        # Full recompute runs the depths' layers again, not their heads.
        full = replace(cfg, recompute="full")
        again = acc.gpt_hardware_flops_per_iteration(full, b, s)
        again -= acc.gpt_model_flops_per_iteration(full, b, s)
        assert again == sum(acc.transformer_forward_flops(layers, b, s))


# --- speculative generation -------------------------------------------------------------------


def _wrong(token: int) -> int:
    return (token + 1) % VOCAB


@pytest.mark.parametrize("drafts", ["mtp", "oracle", "every-third-wrong", "wrong"])
def test_speculative_mtp_generates_plain_greedy_tokens(gloo_world_of_one, monkeypatch, drafts):
    from megatrain.inference import speculative
    from megatrain.inference.generate import Sampling, generate

    model = GPTModel(
        _cfg(mtp_num_layers=3, init_method_std=0.3), seed=3, parallel=ParallelContext()
    )
    model.eval()
    sampling = Sampling(max_new_tokens=24, greedy=True, stop_at_eod=False)
    prompts = [[5, 17, 3], [101, 7, 7, 9, 42, 8]]
    plain = {tuple(p): generate(model, p, sampling) for p in prompts}
    if drafts != "mtp":  # drafts of a known quality: the rounds accept all, some or none

        def drafted(model, states, tokens, count):
            prompt = next(p for p in prompts if tokens[: len(p)] == p)
            whole = [*prompt, *plain[tuple(prompt)]]
            right = whole[len(tokens) : len(tokens) + count]
            if drafts == "wrong":
                return [_wrong(t) for t in right]
            if drafts == "every-third-wrong":
                return [_wrong(t) if (len(tokens) + i) % 3 == 0 else t for i, t in enumerate(right)]
            return right

        monkeypatch.setattr(speculative, "_draft", drafted)
    for prompt in prompts:
        new, stats = speculative.generate_speculative(model, prompt, sampling)
        assert new == plain[tuple(prompt)], (drafts, prompt)
        assert stats["drafted"] > 0
        if drafts == "oracle":
            assert stats["accepted"] == stats["drafted"]
        if drafts == "wrong":
            assert stats["accepted"] == 0
        if drafts == "every-third-wrong":
            assert 0 < stats["accepted"] < stats["drafted"]


def _train_with_mtp(corpus: str, out: str) -> dict:
    from megatrain.run.loop import train

    overrides = [
        "model.num_layers=2", "model.hidden_size=32", "model.num_attention_heads=4",
        "model.max_position_embeddings=64", "model.make_vocab_size_divisible_by=64",
        "model.hidden_dropout=0.0", "model.attention_dropout=0.0",
        "model.mtp_num_layers=2", "model.mtp_loss_scaling_factor=1.0",
        "training.seq_length=32", "training.micro_batch_size=4", "training.global_batch_size=8",
        "training.train_iters=60", "training.eval_interval=60", "training.eval_iters=1",
        "optimizer.lr=0.01", "optimizer.lr_warmup_iters=4", "logging.log_interval=20",
        "logging.tensorboard=false", "logging.peak_tflops=1.0", f"data.corpus={corpus!r}",
        f"training.output_dir={out + '/run'!r}", f"checkpoint.save={out + '/ckpt'!r}",
    ]  # fmt: skip
    return train(load_config(None, overrides))


def test_generate_speculative_mtp_command(tmp_path):
    """A GPT trained with two depths on the tiny grammar: `generate --speculative mtp` gives
    plain greedy's text at tp 1 and tp 2 and says how many drafts the model accepted."""
    from click.testing import CliRunner

    from megatrain.cli import main
    from megatrain.testing import grammar_texts, write_text_corpus

    corpus, _ = write_text_corpus(tmp_path / "corpus", grammar_texts(120))
    history = run_distributed(_train_with_mtp, 1, args=(str(corpus), str(tmp_path)), timeout=600)
    assert history[0]["mtp_loss/depth2"][-1] < history[0]["mtp_loss/depth2"][0] - 1.0
    runner = CliRunner()
    base = ["generate", "--ckpt", str(tmp_path / "ckpt"), "--prompt", "the cat sat on"]
    base += ["--greedy", "--max-new-tokens", "24", "--keep-going"]
    plain = runner.invoke(main, base)
    assert plain.exit_code == 0, plain.output
    for tp in ("1", "2"):
        result = runner.invoke(main, [*base, "--speculative", "mtp", "--tp", tp])
        assert result.exit_code == 0, result.output
        text, stats = result.output.rsplit("--- speculative mtp: ", 1)
        assert text == plain.output, (tp, result.output)
        accepted, drafted = (int(x) for x in stats.split(" drafts")[0].split(" of "))
        assert drafted > 0 and accepted > 0, stats  # the trained depths draft what it says
    sampled = runner.invoke(main, [*base[:-4], "--speculative", "mtp"])
    assert sampled.exit_code == 2 and "give --greedy" in sampled.output
