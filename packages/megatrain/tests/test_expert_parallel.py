"""Expert parallelism in training (parallel.expert_model_parallel_size,
expert_tensor_parallel_size, model.moe_token_dispatcher_type): every layout takes the
one-process steps of a mixture-of-experts Llama.

One 1-rank spawn trains the references (softmax top-2 with the aux and z losses; sigmoid
with DeepSeek-V3's expert bias, at 2 and 4 layers; a capacity that drops tokens); one 4-rank
spawn trains the layouts: ep 2 with the distributed optimizer (experts sharded over expert
DP 2) and ep 4 (all-to-all dispatch), tp 2 with sequence parallelism at etp 1 (full
recompute, the distributed optimizer) and etp 2 (all-gather dispatch), pp 2 under 1F1B, ZB-H1
and interleaved (vpp 2), ep 4 with capacity, cp 2 x ep 2 (the aux and z losses' shares under
context parallelism), FSDP2 with the experts sharded over expert DP 2 (dp 4 x ep 2, and
tp 2 x dp 2 x ep 2 x etp 1 reduce-scattering each of 2 microbatches; cp 2 x dp 2 x ep 2,
the experts' gradients divided by dp x cp), and bf16 at ep 2; a run
saved at ep 4 goes on at ep 4 (bitwise), tp 2 x ep 2 and ep 1, and, with the expert bias
switched on, from zero biases with a warning; one saved at FSDP dp 4 x ep 2 goes on at ep 2
with the distributed optimizer and at FSDP tp 2 x ep 2 (expert DP 1);
the sigmoid run at pp 2 x ep 2 (ZB-H1, distributed optimizer), saved in the background after
a step, resumes bitwise, its expert biases with it.  DeepSeek-V3's routing (8 experts in 4
groups, 2 chosen, top-2 group score, scaled, a shared expert, a first dense layer, the
sequence-wise aux loss) at ep 2 with each token sent once per rank
(model.moe_group_limited_dispatch); DeepSeek-V3 at ep 4 (multi-latent attention, top 3
of the best 2 groups' experts, one MTP depth with its own MoE layer; packed documents in one
case) with that dispatch and with the plain all-to-all, the dispatches recorded: each
token's experts on exactly topk_group = 2 of the 4 ranks, and the per-rank dispatch sending
it to each of them once; and gpt-oss's MLP (router and expert biases, the clamped
(up + 1) quick-GeGLU; biases in attention too) at ep 2 and at tp 2 x ep 2 x etp 2 (fc1's
bias split with its columns, fc2's shared out by h's), whose saved weights after the steps are
one process's too.  Equal losses, gradient norms and
validation loss (and the MTP depth's training and validation losses) show the expert
gradients' reduction and scale, the norm that counts each
expert once (Megatron-LM PR #5916) and the aux loss over the sequence's TP ranks (#1652); the
expert-bias counts are checked summed over the stage.
Every rank runs under the NCCL-semantics checker.
At tp 2 x etp 2 with the distributed optimizer a save hands DCP views of the run's own
tensors only, strided gate and up pieces included, and resumes bitwise, saved synchronously
or in the background.
megacore's tests prove the dispatchers against one process (test_token_dispatcher)."""

import contextlib
import io
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from megacore import parallel_state as ps
from megacore.testing import run_distributed
from megatrain.checkpoint import save as saving
from megatrain.checkpoint.convert import convert
from megatrain.checkpoint.dcp import Pieces, module_of
from megatrain.checkpoint.files import CheckpointError
from megatrain.checkpoint.load import read_full_state
from megatrain.config import ConfigError, load_config, validate
from megatrain.hf.llama import export_llama
from megatrain.models import build_model_chunks, model_config, moe
from megatrain.parallelize import sum_expert_loads
from megatrain.run.loop import train
from megatrain.testing import QUIET_LOGGING, TINY_MODEL, assert_same_steps, write_counting_corpus

VOCAB = 200
STEPS = 2
FP32_TOL = 2e-5
COMMON = [
    *TINY_MODEL,
    "model.num_layers=2",
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
MOE = [
    'model.kind="llama"',
    "model.normalization='rmsnorm'",
    "model.position_embedding_type='rope'",
    "model.init_method_std=0.1",
    "model.num_moe_experts=4",
    "model.moe_router_topk=2",
    "model.moe_ffn_hidden_size=16",
    "model.moe_aux_loss_coeff=0.01",
    "model.moe_z_loss_coeff=0.001",
    "model.moe_grouped_gemm=false",  # the loop: faster than torch's CPU grouped GEMM here
]
ROUTING = {
    "softmax": [],
    "sigmoid-bias": [
        "model.moe_router_score_function='sigmoid'",
        "model.moe_router_enable_expert_bias=true",
        "model.moe_router_bias_update_rate=0.05",  # moves the routing of step 2
    ],
    "capacity": ["model.moe_expert_capacity_factor=1.0"],
    # Per-sequence balance: its counts are per sequence, whose tokens SP and CP split apart.
    "seq-aux": ["model.moe_router_load_balancing_type='seq_aux_loss'"],
}
# Two layers a chunk for the interleaved pipeline (pp 2 x vpp 2).
ROUTING["sigmoid-bias-4-layers"] = [*ROUTING["sigmoid-bias"], "model.num_layers=4"]
ROUTING["deepseek"] = [
    *ROUTING["sigmoid-bias"], "model.num_moe_experts=8", "model.moe_router_num_groups=4",
    "model.moe_router_group_topk=2", "model.moe_router_group_score_topk=2",
    "model.moe_router_topk_scaling_factor=2.5", "model.moe_shared_expert_intermediate_size=16",
    "model.moe_layer_freq=[0, 1]", "model.moe_router_load_balancing_type='seq_aux_loss'",
]  # fmt: skip
# DeepSeek-V3 at ep 4: MLA, top 3 of the 2 best groups' 4 experts (so a token's 3 experts
# span at most 2 of the 4 ranks, one group each, where top 3 of all 8 would span 3), one MTP
# depth (an MoE layer too); alone and on packed documents.
ROUTING["deepseek-mtp"] = [
    *ROUTING["deepseek"], "model.moe_router_topk=3", "model.multi_latent_attention=true",
    "model.q_lora_rank=12", "model.kv_lora_rank=8", "model.qk_head_dim=6",
    "model.qk_pos_emb_head_dim=4", "model.v_head_dim=5", "model.mtp_num_layers=1",
    "model.mtp_loss_scaling_factor=0.3",
]  # fmt: skip
PACKED = ["data.reset_position_ids=true", "data.reset_attention_mask=true",
          "data.eod_mask_loss=true"]  # fmt: skip
ROUTING["deepseek-mtp-packed"] = [*ROUTING["deepseek-mtp"], *PACKED]
ROUTING["gpt-oss"] = [
    "model.add_bias_linear=true", "model.quick_geglu=true", "model.glu_linear_offset=1.0",
    "model.activation_func_clamp_value=0.3",  # small: the clamps act at this init
]  # fmt: skip


def ep(size):
    return [f"parallel.expert_model_parallel_size={size}"]


TP2_SP = ["parallel.tensor_model_parallel_size=2", "parallel.sequence_parallel=true"]
FULL = ["parallel.data_parallel_sharding='full'"]
PP2 = ["parallel.pipeline_model_parallel_size=2"]
# name: (routing, overrides); 4 ranks each (dp fills the rest).
LAYOUTS = {
    "ep2-alltoall-distopt": ("softmax", [*ep(2), "parallel.use_distributed_optimizer=true"]),
    "ep4-alltoall": ("softmax", ep(4)),
    "tp2-sp-ep2-etp1-full-recompute-distopt": (
        "softmax", [*TP2_SP, *ep(2), "parallel.expert_tensor_parallel_size=1",
                    'model.recompute="full"', "parallel.use_distributed_optimizer=true"]),
    "tp2-sp-ep2-etp2-allgather": (
        "softmax", [*TP2_SP, *ep(2), "model.moe_token_dispatcher_type='allgather'"]),
    "pp2-ep2-1f1b": ("sigmoid-bias", [*PP2, *ep(2)]),
    "pp2-ep2-zb-h1-distopt": (
        "sigmoid-bias", [*PP2, *ep(2), 'parallel.pipeline_schedule="zb-h1"',
                         "parallel.use_distributed_optimizer=true"]),
    "pp2-vpp2-ep2": (
        "sigmoid-bias-4-layers", [*PP2, *ep(2), "parallel.virtual_pipeline_model_parallel_size=2"]),
    "ep4-capacity": ("capacity", ep(4)),
    "cp2-ep2": ("softmax", [*ep(2), "parallel.context_parallel_size=2"]),
    "tp2-sp-cp2-ep2-seq-aux": ("seq-aux", [*TP2_SP, "parallel.context_parallel_size=2", *ep(2)]),
    "ep2-deepseek-group-limited-dispatch": (
        "deepseek", [*ep(2), "model.moe_group_limited_dispatch=true"]),
    "ep4-deepseek-mtp-group-limited-dispatch": (
        "deepseek-mtp", [*ep(4), "model.moe_group_limited_dispatch=true"]),
    "ep4-deepseek-mtp-alltoall": ("deepseek-mtp", ep(4)),
    "ep4-deepseek-mtp-packed-group-limited-dispatch": (
        "deepseek-mtp-packed", [*ep(4), "model.moe_group_limited_dispatch=true"]),
    "ep2-gpt-oss": ("gpt-oss", ep(2)),
    "tp2-sp-ep2-etp2-gpt-oss": ("gpt-oss", [*TP2_SP, *ep(2)]),
    # FSDP2 with the experts sharded over their own expert-data-parallel group of 2 ranks: at
    # dp 4 x ep 2, and at tp 2 x dp 2 x ep 2 x etp 1, whose 2 microbatches each
    # reduce-scatter (expert DP 1 is the FSDP checkpoint's resumed step, `FROM_FSDP`).  The
    # clip (1.0) acts: the norms are ~1.37.
    "fsdp-dp4-ep2": ("softmax", [*FULL, *ep(2)]),
    "fsdp-tp2-sp-dp2-ep2-etp1-reduce-every-microbatch": (
        "softmax", [*FULL, *TP2_SP, *ep(2), "parallel.expert_tensor_parallel_size=1",
                    "parallel.reduce_every_microbatch=true"]),
    # Under context parallelism the dense parameters shard over dp x cp (4) and the experts
    # over expert DP 2, their gradients divided by dp x cp as the dense ones.
    "fsdp-cp2-dp2-ep2": ("softmax", [*FULL, "parallel.context_parallel_size=2", *ep(2)]),
}  # fmt: skip
# Where the FSDP dp 4 x ep 2 checkpoint of one step goes on (`_layouts`).
FROM_FSDP = {
    "fsdp-at-ep2-distopt": [*ep(2), "parallel.use_distributed_optimizer=true"],
    "fsdp-at-fsdp-tp2-sp-ep2": [*FULL, *TP2_SP, *ep(2)],
}
# The layouts whose dispatches are recorded (`_routed`): the ranks each token went to.
ROUTED = [name for name in LAYOUTS if name.startswith("ep4-deepseek")]
# The runs that save their end, and whose saved tensors the test compares with one process's.
SAVED = ("gpt-oss", "tp2-sp-ep2-etp2-gpt-oss")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return str(write_counting_corpus(tmp_path_factory.mktemp("corpus"), VOCAB))


def _config(corpus, out, routing, overrides=()):
    return load_config(
        None,
        [
            f"data.corpus={corpus!r}",
            f"training.output_dir={out!r}",
            *COMMON,
            *MOE,
            *ROUTING[routing],
            *overrides,
        ],
    )


def _trained(config) -> dict | None:
    """`train`'s history, with the logged load-balancing loss of each step (rank 0)."""
    run = train(config)
    if run is not None:
        log = Path(config.training.output_dir) / "log.jsonl"
        records = [json.loads(line) for line in log.read_text().splitlines()]
        run["aux"] = [r["moe_aux_loss"] for r in records]
        run["valid_mtp"] = [r[f"valid_{MTP}"] for r in records if f"valid_{MTP}" in r]
    return run


MTP = "mtp_loss/depth1"


@contextlib.contextmanager
def _routed(seen: list):
    """Every all-to-all dispatch in the block records what it sent: the dispatcher, the
    tokens, the rows sent over EP, the k experts a token takes and how many EP ranks hold
    them (most over the tokens; how many tokens span each count)."""
    from megacore.moe import token_dispatcher as td

    reals = {cls: cls.dispatch for cls in (td.AllToAllDispatcher, td.PerRankAllToAllDispatcher)}

    def recording(real):
        def dispatch(self, hidden, probs, indices):
            out = real(self, hidden, probs, indices)
            ranks = torch.zeros(indices.size(0), self.ep, dtype=torch.long)
            ranks.scatter_(1, indices // self.local, 1)
            spans = ranks.sum(1)
            seen.append({
                "kind": type(self).__name__, "tokens": indices.size(0), "k": indices.size(1),
                "rows": sum(self.input_splits), "ranks": int(spans.sum()),
                "spans": torch.bincount(spans, minlength=self.ep + 1).tolist(),
            })  # fmt: skip
            return out

        return dispatch

    for cls, real in reals.items():
        cls.dispatch = recording(real)
    try:
        yield seen
    finally:
        for cls, real in reals.items():
            cls.dispatch = real


def _saving(name, out) -> list[str]:
    return [f"checkpoint.save='{out}/{name}/end'"] if name in SAVED else []


def _saved(name, out) -> dict | None:
    """Every tensor a `SAVED` run wrote at its end, on rank 0."""
    if name not in SAVED or dist.get_rank() != 0:
        return None
    return read_full_state(f"{out}/{name}/end", progress=False)[1]


def _references(corpus, out):
    runs = {
        routing: _trained(_config(corpus, f"{out}/{routing}", routing, _saving(routing, out)))
        for routing in ROUTING
    }
    runs["gpt-oss"]["saved"] = _saved("gpt-oss", out)
    return runs


# The layout whose run also saves at its end: the expert biases the resumed run must reach.
BIAS_LAYOUT = "pp2-ep2-zb-h1-distopt"


def _bias_resumed(corpus, out):
    """The sigmoid-bias run at pp 2 (ZB-H1) x ep 2 (the distributed optimizer) stopped after
    a step with a background save (checkpoint.async_save), then resumed and saved at its end;
    returns the two runs and, on rank 0, every tensor (expert biases and optimizer state
    included) of the first save, the resumed end and the uninterrupted end."""
    zb, first_ckpt = LAYOUTS[BIAS_LAYOUT][1], f"{out}/bias-ckpt"
    save = [
        "training.exit_interval=1",
        f"checkpoint.save={first_ckpt!r}",
        "checkpoint.async_save=true",
    ]
    first = train(_config(corpus, f"{out}/bias-first", "sigmoid-bias", [*zb, *save]))
    resume = [f"checkpoint.load={first_ckpt!r}", f"checkpoint.save='{out}/bias-end'"]
    resumed = train(_config(corpus, f"{out}/bias-resumed", "sigmoid-bias", [*zb, *resume]))
    ends = None
    if dist.get_rank() == 0:
        ends = {
            name: read_full_state(ckpt, with_optimizer=True, progress=False)[1]
            for name, ckpt in (
                ("first", first_ckpt),
                ("resumed", f"{out}/bias-end"),
                ("whole", f"{out}/{BIAS_LAYOUT}/ckpt"),
            )
        }
    return {"bias-first": first, "bias-resumed": resumed, "bias-ends": ends, "out": out}


def _layouts(corpus, out):
    runs = {}
    for name, (routing, o) in LAYOUTS.items():
        end = [f"checkpoint.save='{out}/{name}/ckpt'"] if name == BIAS_LAYOUT else []
        end += _saving(name, out)
        with _routed([]) if name in ROUTED else contextlib.nullcontext() as seen:
            runs[name] = _trained(_config(corpus, f"{out}/{name}", routing, [*o, *end]))
        runs.setdefault("routing", {})[name] = seen
        if runs[name] is not None and name in SAVED:
            runs[name]["saved"] = _saved(name, out)
    runs.update(_bias_resumed(corpus, out))
    bf16 = [*ep(2), 'training.precision="bf16"']
    runs["ep2-bf16"] = train(_config(corpus, f"{out}/bf16", "softmax", bf16))
    # Stopped after a step with a save at ep 4; the second step at ep 4 (bitwise the
    # uninterrupted run's), at tp 2 x ep 2 (each expert's SwiGLU columns split over etp 2)
    # and at ep 1 with the distributed optimizer (expert state sharded over expert DP 4).
    ckpt = f"{out}/ckpt"
    save = ["training.exit_interval=1", f"checkpoint.save={ckpt!r}"]
    load = [f"checkpoint.load={ckpt!r}"]
    resumed = {
        "at-ep4": ep(4),
        "at-tp2-ep2": [*TP2_SP, *ep(2)],
        "at-ep1-distopt": ["parallel.use_distributed_optimizer=true"],
    }
    runs["loads"] = _expert_loads_summed(_config(corpus, f"{out}/loads", "sigmoid-bias", PP2))
    runs["first"] = train(_config(corpus, f"{out}/first", "softmax", [*ep(4), *save]))
    for name, o in resumed.items():
        runs[name] = train(_config(corpus, f"{out}/{name}", "softmax", [*o, *load]))
    # Stopped after a step at FSDP dp 4 x ep 2 (expert shards over expert DP 2); the second
    # step at ep 2 with the distributed optimizer, and at FSDP again at tp 2 x ep 2 (expert
    # DP 1: unsharded expert units, which still divide; each expert's columns over etp 2).
    fsdp_ckpt = f"{out}/fsdp-ckpt"
    save = ["training.exit_interval=1", f"checkpoint.save={fsdp_ckpt!r}"]
    first = _config(corpus, f"{out}/fsdp-first", "softmax", [*FULL, *ep(2), *save])
    runs["fsdp-first"] = train(first)
    for name, o in FROM_FSDP.items():
        o = [*o, f"checkpoint.load={fsdp_ckpt!r}"]
        runs[name] = train(_config(corpus, f"{out}/{name}", "softmax", o))
    # The softmax checkpoint holds no expert bias: switched on, the biases start from zero,
    # with a warning naming the field.
    with contextlib.redirect_stdout(io.StringIO()) as said:
        from_none = train(_config(corpus, f"{out}/from-none", "sigmoid-bias", [*ep(4), *load]))
    runs["bias-from-none"] = from_none and {**from_none, "said": said.getvalue()}
    return runs


def _expert_loads_summed(config):
    """At pp 2 x dp 2: each rank's MoE layers given loads of their own, summed over the stage
    (`sum_expert_loads`), then the expert-bias update: (loads, biases) of this rank."""
    ps.initialize_model_parallel(1, 2)
    try:
        chunks = build_model_chunks("llama", model_config(config, VOCAB), 1)
        rank = dist.get_rank()
        for i, layer in enumerate(moe.moe_layers(chunks)):
            layer.tokens_per_expert.copy_(torch.tensor([rank, 4 - rank, i, 2 * (rank % 2)]))
        sum_expert_loads(chunks)
        moe.update_expert_biases(chunks, 0.05)
        return [
            (layer.tokens_per_expert.tolist(), layer.router.expert_bias.tolist())
            for layer in moe.moe_layers(chunks)
        ]
    finally:
        ps.destroy_model_parallel()


@pytest.fixture(scope="module")
def references(corpus, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("moe-one"))
    return run_distributed(_references, 1, args=(corpus, out), timeout=300)[0]


@pytest.fixture(scope="module")
def layouts(corpus, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("moe-layouts"))
    # 24 trainings on 4 ranks: the module's tests took 192 s at a load average of 8 on 2 cores.
    results = run_distributed(_layouts, 4, args=(corpus, out), timeout=600)
    routing = [r["routing"] for r in results]
    return {
        **results[0],
        "loads_by_rank": [r["loads"] for r in results],
        "routing_by_rank": routing,
    }


def test_every_expert_parallel_layout_equals_one_process(references, layouts):
    for name, (routing, _) in LAYOUTS.items():
        assert_same_steps(layouts[name], references[routing], name, FP32_TOL)
        # The logged load-balancing loss is one process's too (Megatron-LM #1652, #3672).
        for a, b in zip(layouts[name]["aux"], references[routing]["aux"], strict=True):
            assert abs(a - b) < FP32_TOL, (name, layouts[name]["aux"], references[routing]["aux"])
        if MTP in references[routing]:  # each MTP depth's losses, trained and validated
            for key in (MTP, "valid_mtp"):
                got, want = layouts[name][key], references[routing][key]
                assert len(got) == len(want) > 0, (name, key, got, want)
                for a, b in zip(got, want, strict=True):
                    assert abs(a - b) < FP32_TOL, (name, key, got, want)
    # The routings train differently: each reference is its own.
    losses = {tuple(r["loss"]) for r in references.values()}
    assert len(losses) == len(ROUTING)
    # gpt-oss's at tp 2 x ep 2 x etp 2 ends with one process's weights, the router's bias and
    # each expert's biases (bias1 by columns, bias2 by h's columns over etp) among them.
    whole, split = references["gpt-oss"]["saved"], layouts["tp2-sp-ep2-etp2-gpt-oss"]["saved"]
    biases = [n for n in whole if n.endswith(("experts.bias1", "experts.bias2", "router.bias"))]
    assert len(biases) == 6 and whole.keys() == split.keys()
    for name in biases:  # the steps moved them off their zero start
        assert whole[name].abs().min() > 0, name
    for name, tensor in whole.items():
        torch.testing.assert_close(split[name], tensor, rtol=0, atol=FP32_TOL, msg=name)
    # bf16 at ep 2 follows fp32's steps, and is active (not fp32's numbers).
    bf16, fp32 = layouts["ep2-bf16"], references["softmax"]
    for a, b in zip(bf16["loss"], fp32["loss"], strict=True):
        assert abs(a - b) < 0.05, (bf16["loss"], fp32["loss"])
    assert bf16["loss"] != fp32["loss"]


def test_group_limited_dispatch_sends_each_token_to_at_most_topk_group_ranks(layouts):
    """DeepSeek's node-limited routing at ep 4 (a group of 2 experts on each rank, a token's
    top 3 experts from its best 2 groups): every token's experts lie on exactly 2 EP ranks (top
    3 of all 8 would put some on 3), and with model.moe_group_limited_dispatch the token
    crosses to each of them once (2 rows a token, where the plain all-to-all sends k = 3), in
    each MoE layer (the second decoder layer, the MTP depth's), on every rank."""
    for name in ROUTED:
        per_token = "group-limited-dispatch" in name
        for rank, routing in enumerate(layouts["routing_by_rank"]):
            seen = routing[name]
            # One microbatch a rank each step and one validation batch, 2 MoE layers each.
            assert len(seen) == 2 * (STEPS + 1), (name, rank, seen)
            for record in seen:
                assert record["kind"] == (
                    "PerRankAllToAllDispatcher" if per_token else "AllToAllDispatcher"
                ), (name, record)
                assert record["k"] == 3 and len(record["spans"]) == 5, record
                # The routing: each token's 3 experts on topk_group = 2 ranks, no more.
                assert record["spans"] == [0, 0, record["tokens"], 0, 0], (name, rank, record)
                want = record["ranks"] if per_token else record["k"] * record["tokens"]
                assert record["rows"] == want, (name, rank, record)


def test_expert_loads_summed_over_the_stage_before_the_bias_update(layouts):
    # pp 2 x dp 2: ranks 0, 1 hold stage 0, ranks 2, 3 stage 1 (one MoE layer each); the
    # loads every rank of the job gave, as one stage's ranks summed them.
    for rank, loads in enumerate(layouts["loads_by_rank"]):
        ((tokens, bias),) = loads
        stage = [r for r in range(4) if r // 2 == rank // 2]
        assert tokens == [sum(r for r in stage), sum(4 - r for r in stage), 0, 2], rank
        mean = sum(tokens) / 4
        assert bias == pytest.approx([0.05 * ((mean > t) - (mean < t)) for t in tokens]), rank


def test_an_ep4_checkpoint_goes_on_at_tp2_ep2_and_ep1(references, layouts):
    reference, whole, first = references["softmax"], layouts["ep4-alltoall"], layouts["first"]
    assert first["stopped_at"] == 1
    for name in ("at-ep4", "at-tp2-ep2", "at-ep1-distopt"):
        run = layouts[name]
        steps = {k: first[k] + run[k] for k in ("loss", "grad_norm")}
        steps["valid"] = run["valid"]
        assert_same_steps(steps, reference, name, FP32_TOL)
    # At the saving layout the resumed step is the uninterrupted one, bit for bit.
    resumed = layouts["at-ep4"]
    assert resumed["loss"] == whole["loss"][1:] and resumed["grad_norm"] == whole["grad_norm"][1:]
    assert resumed["valid"] == whole["valid"]
    # An FSDP + EP checkpoint (dense shards over DP 4, expert shards over expert DP 2) takes
    # the reference's second step at ep 2 with the distributed optimizer and at FSDP tp 2.
    first = layouts["fsdp-first"]
    assert first["stopped_at"] == 1
    for name in FROM_FSDP:
        run = layouts[name]
        steps = {k: first[k] + run[k] for k in ("loss", "grad_norm")}
        assert_same_steps({**steps, "valid": run["valid"]}, reference, name, FP32_TOL)
    # With the expert bias switched on, the biases the checkpoint lacks start from zero.
    from_none = layouts["bias-from-none"]
    assert "stopped_at" not in from_none and len(from_none["loss"]) == 1, from_none
    assert "holds no expert bias for model.moe_router_enable_expert_bias" in from_none["said"]


def test_a_run_with_expert_bias_resumes_bitwise(layouts, tmp_path):
    # Saved after step 1 (in the background) at pp 2 x ep 2 under ZB-H1 with the distributed
    # optimizer, the biases moved by step 1's counts: the resumed step 2 is the uninterrupted
    # one, bit for bit, and so are the expert biases (and every other tensor) both runs saved
    # at the end.
    whole, first, resumed = layouts[BIAS_LAYOUT], layouts["bias-first"], layouts["bias-resumed"]
    assert first["stopped_at"] == 1
    assert first["loss"] == whole["loss"][:1] and resumed["loss"] == whole["loss"][1:]
    assert resumed["grad_norm"] == whole["grad_norm"][1:] and resumed["valid"] == whole["valid"]
    ends = layouts["bias-ends"]
    biases = [n for n in ends["whole"] if n.endswith("router.expert_bias")]
    # Step 1 moved every bias: a resume that lost them would route step 2 otherwise.
    assert len(biases) == 2 and all(ends["first"][n].abs().min() > 0 for n in biases)
    assert ends["resumed"].keys() == ends["whole"].keys()
    for name, tensor in ends["whole"].items():
        assert torch.equal(ends["resumed"][name], tensor), name
    # `megatrain convert` to bf16 keeps the biases fp32, bit for bit.
    out = convert(f"{layouts['out']}/bias-end", tmp_path / "bf16", "bfloat16", progress=False)
    converted = read_full_state(out.parent, progress=False)[1]
    for name in biases:
        assert converted[name].dtype == torch.float32, name
        assert torch.equal(converted[name], ends["whole"][name]), name
    assert converted["embedding.weight"].dtype == torch.bfloat16
    # export-hf refuses the biases (HF's mixtures route without one), naming the field.
    meta, _ = read_full_state(out.parent, progress=False)
    meta["config"]["model"]["moe_router_score_function"] = "softmax"  # the bias alone differs
    with pytest.raises(CheckpointError, match=r"model\.moe_router_enable_expert_bias is True"):
        export_llama(meta, out, tmp_path / "hf", "float32")


@pytest.mark.parametrize(
    ("overrides", "pattern"),
    [
        (ep(3), r"model.num_moe_experts \(4\) is not divisible by parallel.expert_model_paral"),
        ([*ep(4), *PP2], r"4 processes, not divisible by the expert layout"),
        (["parallel.tensor_model_parallel_size=2", *ep(2)], "needs parallel.sequence_parallel"),
        ([*ep(2), "parallel.expert_tensor_parallel_size=3"], r"moe_ffn_hidden_size \(16, each"),
        (["model.moe_token_dispatcher_type='deepep'"], "moe_token_dispatcher_type: expected"),
        (["model.num_moe_experts=8", "model.moe_router_topk=9"], "moe_router_topk"),
        # Node-limited dispatch needs whole groups on each rank: 2 groups over 4 ranks.
        (
            [
                *ep(4),
                "model.moe_router_num_groups=2",
                "model.moe_router_group_topk=1",
                "model.moe_group_limited_dispatch=true",
            ],
            r"model.moe_router_num_groups \(2\) must be a multiple of parallel.expert_model_par",
        ),
    ],
)
def test_bad_expert_layouts_refused_naming_the_field(overrides, pattern):
    with pytest.raises(ConfigError, match=pattern):
        validate(load_config(None, [*COMMON, *MOE, *overrides]), 4)


def test_expert_sizes_without_experts_refused():
    with pytest.raises(ConfigError, match=r"set model\.num_moe_experts"):
        validate(load_config(None, [*COMMON, *ep(2)]), 4)


def _spans(tensors) -> list[tuple[int, int]]:
    """The memory of each tensor's storage, [first byte, last byte + 1)."""
    out = []
    for t in tensors:
        storage = t.untyped_storage()
        out.append((storage.data_ptr(), storage.data_ptr() + storage.nbytes()))
    return out


def _extent(t: torch.Tensor) -> tuple[int, int]:
    """The bytes a (possibly strided) view reads, [first, last + 1)."""
    last = sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))
    return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()


def _saved_pieces(state: dict):
    for name, value in state.items():
        if isinstance(value, Pieces):
            for t in value._pieces.values():
                yield name, t
        elif isinstance(value, DTensor):
            yield name, value.to_local()
        elif isinstance(value, torch.Tensor):
            yield name, value


def _what_a_save_holds(run, snap) -> dict:
    """Of `snap`'s weights and optimizer pieces: how many are strided views, and the names
    and bytes of those whose memory is none of the run's parameters, buffers or optimizer
    tensors (a copy made for the save)."""
    optimizer = run.optimizer
    held = [t for c in run.chunks for t in (*c.parameters(), *module_of(c).buffers())]
    held += [s.master for s in optimizer.shards]
    held += [v for state in optimizer.optimizer.state.values() for v in state.values()]
    spans = _spans(t for t in held if isinstance(t, torch.Tensor) and t.numel())
    strided, copies, copied_bytes = 0, [], 0
    for name, t in [*_saved_pieces(snap.model), *_saved_pieces(snap.optimizer)]:
        strided += not t.is_contiguous()
        lo, hi = _extent(t)
        if not any(a <= lo and hi <= b for a, b in spans):
            copies.append(name)
            copied_bytes += t.nbytes
    return {"strided": strided, "copies": copies, "copied_bytes": copied_bytes}


# tp 2 x etp 2: each rank's weight1 holds its slice of the gate and of the up columns, apart
# in the global [gate | up], so its pieces are strided views; under the distributed optimizer
# (expert DP 2) each optimizer state's boxes are cut the same way.
ETP2 = [
    *TP2_SP,
    "parallel.expert_tensor_parallel_size=2",
    "parallel.use_distributed_optimizer=true",
]


def _saves_at_etp2(corpus, out):
    seen = []
    real = saving.snapshot

    def snapshot(run):  # what both save paths (synchronous, background) start from
        snap = real(run)
        seen.append(_what_a_save_holds(run, snap))
        return snap

    saving.snapshot = snapshot
    try:
        results = {"whole": train(_config(corpus, f"{out}/whole", "softmax", ETP2))}
        for how in ("sync", "async"):
            ckpt = f"{out}/ckpt-{how}"
            save = ["training.exit_interval=1", f"checkpoint.save={ckpt!r}",
                    f"checkpoint.async_save={str(how == 'async').lower()}"]  # fmt: skip
            first = train(_config(corpus, f"{out}/first-{how}", "softmax", [*ETP2, *save]))
            load = [f"checkpoint.load={ckpt!r}"]
            second = train(_config(corpus, f"{out}/second-{how}", "softmax", [*ETP2, *load]))
            results[how] = (first, second)
    finally:
        saving.snapshot = real
    return {**results, "seen": seen}


def test_saved_expert_pieces_are_the_runs_memory_and_resume_bitwise(corpus, tmp_path):
    """What a save hands torch.distributed.checkpoint at tp 2 x etp 2: every piece of the
    weights and of the optimizer state is memory the run holds, not a copy (before, a copy of
    each strided piece lived until the write ended: GBs of GPU memory at a real size), and the
    checkpoint, written synchronously or in the background, resumes the run bit for bit."""
    per_rank = run_distributed(_saves_at_etp2, 4, args=(corpus, str(tmp_path)), timeout=400)
    for rank, results in enumerate(per_rank):
        assert len(results["seen"]) == 2, rank  # one save each, synchronous and background
        for seen in results["seen"]:
            assert seen["strided"] > 0, (rank, seen)  # the case is there
            assert seen["copies"] == [] and seen["copied_bytes"] == 0, (rank, seen)
    whole = per_rank[0]["whole"]
    for how in ("sync", "async"):
        first, second = per_rank[0][how]
        assert first["stopped_at"] == 1, how
        assert first["loss"] + second["loss"] == whole["loss"], how  # bitwise
        assert first["grad_norm"] + second["grad_norm"] == whole["grad_norm"], how
        assert second["valid"] == whole["valid"], how
