"""GPT-2 (or Llama) training throughput on the CPU: megatrain's step beside Hugging Face's.

    python benchmarks/bench_gpt_train.py --out bench-results/gpt_train.json
    python benchmarks/bench_gpt_train.py --model llama --out bench-results/llama_train.json
    python benchmarks/bench_gpt_train.py --model mixtral --out bench-results/mixtral_train.json
    python benchmarks/bench_gpt_train.py --model deepseek --out bench-results/deepseek_train.json

`--model llama` trains our Llama (`LLAMA` below) beside `transformers.LlamaForCausalLM` of the
same shape, everything else as for GPT-2.  `--model mixtral` makes every MLP of that Llama a
mixture of 8 SwiGLU experts of 1024, 2 per token (`MIXTRAL`), beside
`transformers.MixtralForCausalLM` at its default experts implementation (recorded in the
JSON); `--model deepseek` makes that Llama a DeepSeek-V3 (`DEEPSEEK`: multi-latent attention,
a dense first layer, group-limited sigmoid routing with the correction bias, a shared expert)
beside `transformers.DeepseekV3ForCausalLM` with its eager experts, both from HF's weights
(`start_from_hf`: the first losses are equal, and the logits' difference is recorded).
Neither side computes a load-balancing loss (HF's only with output_router_logits), so both
do the same work.  For the mixture the JSON also says what the token dispatch costs
(`moe_dispatch`): one MoE layer of ours on the step's tokens, forward and backward, its
router, permute (dispatch) and unpermute (combine) timed apart from the experts' grouped
GEMMs, and their share of the step.

Our side is the step `megatrain run` takes: a `megatrain.run.setup.Run` from
`build_run` (a 1-process gloo group, DDP-wrapped chunks, `MegatronOptimizer`,
`GPTBatches` over a synthetic megadata-format corpus of random tokens written to
a temporary directory), one `train_step(run)` per iteration.  Beside it,
`transformers.GPT2LMHeadModel` of the same shape (6 layers, hidden 384, 6 heads,
seq 256, vocab 8192, no dropout, SDPA attention) trained with
`torch.optim.AdamW` (same lr schedule, betas, eps; weight decay 0.01 on 2-D
parameters only) and `clip_grad_norm_(..., 1.0)`, on the very same batches (a
second `GPTBatches` with the same corpus and seed); its loss is the mean cross
entropy of its logits against our loader's `labels` (HF's own `labels=` shifts
inside the model, which would drop one target per sample).  Micro = global batch 8
(one microbatch), fp32, the same torch thread count.  After the warm-up steps
of each, the timed steps run in blocks of `--block` steps ordered HF, ours, ours,
HF, HF, ... (ABBA), so machine drift hits both alike.  Blocks rather than one
step each: both models share the process's malloc, and HF's step (which makes
~0.4 GB of short-lived temporaries and page-faults them in) ran ~20% slower
right after one of ours than after one of its own; `--block 1` shows that.

Reported per model: tokens/s (median over the timed steps; total tokens / total
time; the fastest step), ms/step, model TFLOP/s of the median step by the paper's
count (`gpt_model_flops_per_iteration`; no recompute, so HFU = MFU; the same formula
for HF, same shape), MFU against a measured fp32 matmul rate (`megatrain.run.metrics.
measured_matmul_tflops`, what `megatrain run` takes as a CPU's peak; measured
before and after the steps, the higher kept), parameters, page faults and system
CPU time per step, the losses (the first near ln 8192 = 9.01 on both sides: the
same work), and ours / HF tokens/s.  The load average before the run and the CPU
time stolen by a hypervisor during it are recorded: other work on the cores shows
up as slow, scattered steps.
"""

import argparse
import contextlib
import hashlib
import json
import math
import os
import platform
import resource
import socket
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megacommon.corpus_format import SHARD_BATCH_ROWS
from megacore import parallel_state as ps
from megacore.moe import grouped_gemm_available as moe_grouped_gemm_available
from megatrain.config import load_config
from megatrain.data.corpus import open_corpus
from megatrain.data.samples import GPTBatches
from megatrain.plan.accounting import gpt_model_flops_per_iteration, gpt_parameters
from megatrain.run.metrics import measured_matmul_tflops
from megatrain.run.setup import build_run
from megatrain.run.step import lr_for, train_step
from megatrain.testing import EOD, write_corpus

VOCAB, LAYERS, HIDDEN, HEADS, SEQ, BATCH = 8192, 6, 384, 6, 256, 8
# --model llama: the same depth and width as a Llama (6 heads sharing 2 key/value heads,
# SwiGLU of 1024, about 8h/3, RMSNorm, rotary positions, no biases, an untied output layer).
LLAMA = ['model.kind="llama"', "model.num_query_groups=2", "model.ffn_hidden_size=1024"]
# --model mixtral: that Llama with 8 experts of 1024 in every layer, 2 per token (Mixtral's
# routing: the top 2 logits, a softmax over them), dropless, no load-balancing loss.
MIXTRAL = [*LLAMA, "model.num_moe_experts=8", "model.moe_router_topk=2",
           'model.moe_router_load_balancing_type="none"', "model.moe_aux_loss_coeff=0"]  # fmt: skip
# --model gpt-oss: that mixture as gpt-oss builds it: sinks, sliding windows of 128 on every
# other layer, biases on every linear (the router's and the experts' too), the clamped
# (up + 1) gate sigmoid(1.702 gate) experts; HF's GptOssForCausalLM of the same shape beside
# it (eager attention: gpt-oss has no SDPA path in transformers, whose sinks need the scores).
GPT_OSS = [*MIXTRAL, "model.add_bias_linear=true", 'model.softmax_type="learnable"',
           "model.quick_geglu=true", "model.glu_linear_offset=1.0",
           "model.activation_func_clamp_value=7.0", "model.window_size=128",
           "model.layer_types=" + str(["sliding_attention", "full_attention"] * (LAYERS // 2))
           .replace("'", '"')]  # fmt: skip

# --model deepseek: that Llama as DeepSeek-V3 builds it: multi-latent attention (queries through
# a 192-wide latent, keys and values from one 128-wide latent and a shared 32-wide rope key;
# heads of 64 + 32, values of 64, DeepSeek-V3's proportions), the first layer dense and the
# other five 8 SwiGLU experts of 512 with one shared expert of 512, DeepSeek-V3's routing
# (sigmoid scores with the selection-only bias, 4 groups ranked by their top-2 sums, the best 2
# taken, 2 experts a token, normalized, scaled by 2.5); no balance loss and no bias update
# (transformers computes neither), no MTP (DeepseekV3ForCausalLM drops it).  HF's
# DeepseekV3ForCausalLM of the same shape starts from the same weights (ours read from its
# files, as `megatrain run --load-hf` reads them) with its eager experts.
DEEPSEEK = ['model.kind="llama"', "model.ffn_hidden_size=1024",
            "model.multi_latent_attention=true", "model.q_lora_rank=192",
            "model.kv_lora_rank=128", "model.qk_head_dim=64", "model.qk_pos_emb_head_dim=32",
            "model.v_head_dim=64", "model.num_moe_experts=8", "model.moe_router_topk=2",
            "model.moe_ffn_hidden_size=512", "model.moe_shared_expert_intermediate_size=512",
            "model.moe_layer_freq=" + str([0] + [1] * (LAYERS - 1)),
            'model.moe_router_score_function="sigmoid"', "model.moe_router_enable_expert_bias=true",
            "model.moe_router_bias_update_rate=0.0", "model.moe_router_num_groups=4",
            "model.moe_router_group_topk=2", "model.moe_router_group_score_topk=2",
            "model.moe_router_norm_topk_prob=true", "model.moe_router_topk_scaling_factor=2.5",
            'model.moe_router_load_balancing_type="none"',
            "model.moe_aux_loss_coeff=0"]  # fmt: skip
OVERRIDES = {"llama": LLAMA, "mixtral": MIXTRAL, "gpt-oss": GPT_OSS, "deepseek": DEEPSEEK}


# -- a synthetic corpus, written by megatrain.testing.write_corpus in megadata's format ----------


def random_docs(
    rng: np.random.Generator, tokens: int, vocab_size: int = VOCAB, doc_len: int = 4096
) -> list[list[int]]:
    docs = []
    while sum(map(len, docs)) < tokens:
        doc = rng.integers(1, vocab_size, size=doc_len - 1).tolist()
        docs.append([*doc, EOD])
    return docs


# -- machine -----------------------------------------------------------------------------------


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_steal_seconds() -> float | None:
    """CPU time the hypervisor gave to others (all cores), from /proc/stat; None elsewhere."""
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()
        return int(fields[8]) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- the Hugging Face side ---------------------------------------------------------------------


def hf_gpt2_config(config, vocab_size: int):
    """transformers' GPT-2 of our config's shape and dropout (SDPA attention)."""
    import transformers

    m = config.model
    return transformers.GPT2Config(
        vocab_size=vocab_size,
        n_positions=m.max_position_embeddings,
        n_embd=m.hidden_size,
        n_layer=m.num_layers,
        n_head=m.num_attention_heads,
        n_inner=config.ffn_hidden_size,
        resid_pdrop=m.hidden_dropout,
        embd_pdrop=m.hidden_dropout,
        attn_pdrop=m.attention_dropout,
        layer_norm_epsilon=m.layernorm_epsilon,
        initializer_range=m.init_method_std,
        bos_token_id=EOD,
        eos_token_id=EOD,
        attn_implementation="sdpa",
    )


def hf_llama_config(config, vocab_size: int, experts: str | None = None):
    """transformers' Llama of our Llama config's shape (GQA, SwiGLU, RMSNorm, rope and its
    scaling, untied), as `megatrain export-hf` writes it (SDPA attention); a mixture's
    `experts` implementation HF's default unless given ("eager": its loop over the experts)."""
    import dataclasses

    import transformers

    from megatrain.config import MODEL_SWITCHES
    from megatrain.hf.llama import llama_config_fields

    m = dataclasses.asdict(config.model) | {n: config.model_switch(n) for n in MODEL_SWITCHES}
    m["ffn_hidden_size"] = config.ffn_hidden_size
    fields = llama_config_fields(m, vocab_size, EOD, EOD, "float32")
    if m["num_moe_experts"]:  # Mixtral or gpt-oss, as `megatrain export-hf` writes it
        from megatrain.hf.families import decoder_family
        from megatrain.hf.windows import window_fields

        family = decoder_family(m)
        fields = fields | family.fields(m) | window_fields(family, m)
        fields["architectures"] = [family.architecture]
        attention = "eager" if family.architecture == "GptOssForCausalLM" else "sdpa"
        kw = {"experts_implementation": experts} if experts else {}
        return getattr(transformers, family.config_class)(
            **fields, attn_implementation=attention, **kw
        )
    return transformers.LlamaConfig(**fields, attn_implementation="sdpa")


class HFTrainer:
    """GPT2LMHeadModel (LlamaForCausalLM for a Llama config) with AdamW, clipping and lr exactly
    as our config asks, on our batches.

    The shape and dropout are the config's; `vocab_size` is ours after padding, so both
    models do the same matmuls.  On a GPU (bench_gpu.py) the weights stay fp32 and the
    forward runs under `torch.autocast(autocast_dtype)`, the usual HF mixed precision;
    `recompute` turns on HF's gradient checkpointing (every block again in backward, as our
    full recompute).
    """

    def __init__(
        self,
        config,
        batches: "GPTBatches",
        seed: int,
        vocab_size: int = VOCAB,
        device: torch.device | None = None,
        autocast_dtype: torch.dtype | None = None,
        recompute: bool = False,
        experts: str | None = None,
    ):
        import transformers

        o, m = config.optimizer, config.model
        self.config, self.batches, self.iteration = config, batches, 0
        self.device = device or torch.device("cpu")
        self.autocast_dtype = autocast_dtype
        torch.manual_seed(seed)
        if m.kind == "llama":
            hf_config = hf_llama_config(config, vocab_size, experts)
            model_class = getattr(transformers, hf_config.architectures[0])
            self.model = model_class(hf_config)
        else:
            self.model = transformers.GPT2LMHeadModel(hf_gpt2_config(config, vocab_size))
        self.model.to(self.device)
        if recompute:  # renamed activation_checkpointing_enable in transformers 5.x
            enable = getattr(self.model, "activation_checkpointing_enable", None)
            (enable or self.model.gradient_checkpointing_enable)({"use_reentrant": False})
        self.model.train()
        params = [p for p in self.model.parameters() if p.requires_grad]  # tied wte once
        self.optimizer = torch.optim.AdamW(
            [
                {"params": [p for p in params if p.dim() > 1], "weight_decay": o.weight_decay},
                {"params": [p for p in params if p.dim() <= 1], "weight_decay": 0.0},
            ],
            lr=o.lr,
            betas=(o.adam_beta1, o.adam_beta2),
            eps=o.adam_eps,
        )
        self.params = params

    @property
    def attn_implementation(self) -> str:
        return self.model.config._attn_implementation

    @property
    def experts_implementation(self) -> str | None:
        """A mixture's experts as HF runs them (its default: grouped_mm where torch can)."""
        return getattr(self.model.config, "_experts_implementation", None)

    def step(self) -> dict:
        o = self.config.optimizer
        lr = lr_for(self.config, self.iteration)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        batch = next(self.batches)
        tokens = torch.as_tensor(batch["tokens"], dtype=torch.long).to(self.device)
        labels = torch.as_tensor(batch["labels"], dtype=torch.long).to(self.device)
        with torch.autocast(
            self.device.type, self.autocast_dtype, enabled=self.autocast_dtype is not None
        ):
            logits = self.model(input_ids=tokens, use_cache=False).logits
        loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), labels.view(-1))
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, o.clip_grad)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.iteration += 1
        return {"loss": loss.item(), "lr": lr, "grad_norm": float(grad_norm)}


class Recorder:
    """A loader that keeps a digest of every batch it handed out."""

    def __init__(self, batches: "GPTBatches"):
        self.batches, self.digests = batches, []

    def __iter__(self) -> "Recorder":
        return self

    def __next__(self) -> dict:
        batch = next(self.batches)
        digest = hashlib.sha256(batch["tokens"].tobytes() + batch["labels"].tobytes())
        self.digests.append(digest.hexdigest())
        return batch


# -- measuring ---------------------------------------------------------------------------------


def summarize(
    seconds: list[float],
    losses: list[float],
    flops: float,
    peak: float,
    tokens: int = BATCH * SEQ,
    hardware_flops: float | None = None,
) -> dict:
    """Throughput of timed steps; `flops` the model FLOPs of a step (MFU), `hardware_flops`
    with recomputation (HFU, = MFU when not given)."""
    median = statistics.median(seconds)
    mean = sum(seconds) / len(seconds)
    tflops = flops / median / 1e12
    hardware_tflops = (flops if hardware_flops is None else hardware_flops) / median / 1e12
    return {
        "tokens_per_s_median": tokens / median,
        "tokens_per_s_mean": tokens / mean,  # total tokens / total time
        "tokens_per_s_best": tokens / min(seconds),  # least disturbed by other load
        "ms_per_step_median": median * 1e3,
        "ms_per_step_mean": mean * 1e3,
        "ms_per_step_min": min(seconds) * 1e3,
        "ms_per_step_max": max(seconds) * 1e3,
        "model_tflops": tflops,
        "hardware_tflops": hardware_tflops,
        "mfu": tflops / peak,
        "hfu": hardware_tflops / peak,
        "step_ms": [round(s * 1e3, 2) for s in seconds],
        "losses": [round(x, 4) for x in losses],
    }


def profile_step(step, rows: int, cuda: bool = False) -> list[dict]:
    """One step under torch.profiler: the ops with the most self CPU time, or with `cuda` the
    most self GPU time (the kernels launched under each op)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        step()
        if cuda:
            torch.cuda.synchronize()
    attr = "self_device_time_total" if cuda else "self_cpu_time_total"
    events = sorted(prof.key_averages(), key=lambda e: getattr(e, attr), reverse=True)
    total = sum(getattr(e, attr) for e in events) or 1
    return [
        {
            "op": e.key,
            "self_ms": round(getattr(e, attr) / 1e3, 2),
            "share": round(getattr(e, attr) / total, 4),
            "calls": e.count,
        }
        for e in events[:rows]
    ]


def moe_dispatch_cost(run, step_seconds: float, repeats: int = 7) -> dict:
    """What the token dispatch costs in a step of ours: the first MoE layer of `run` on a
    step's tokens (SEQ x BATCH of HIDDEN, random), each part run forward and then backward on
    its own (the parts cut apart by detached inputs, so each backward is its own), the median
    of `repeats`: the router (logits, softmax, top k), the permute (dispatch: the sort and the
    gather), the experts' GEMMs (fc1, SwiGLU, fc2 as torch's grouped GEMM where it runs, else
    the loop), the unpermute (combine: the weighted scatter back).  Times the MoE layers of
    the model gives a step's; over the median step time of ours, the share."""
    from megatrain.models.moe import moe_layers

    layers = moe_layers(run.chunks)
    layer = layers[0]
    x = torch.randn(SEQ * BATCH, HIDDEN, generator=torch.Generator().manual_seed(0))
    names = ("router", "permute", "experts", "unpermute")
    seconds = {n: [] for n in names}

    def leaf(t: torch.Tensor) -> torch.Tensor:
        return t.detach().requires_grad_()

    @contextlib.contextmanager
    def clock(name):
        start = time.perf_counter()
        yield
        seconds[name].append(time.perf_counter() - start)

    for _ in range(repeats + 1):  # the first round warms up
        tokens = leaf(x)
        with clock("router"):
            probs, indices = layer.router(tokens, BATCH)
        tokens_d, probs_d = leaf(x), leaf(probs)
        with clock("permute"):
            expert_input, counts = layer.dispatcher.dispatch(tokens_d, probs_d, indices)
        expert_in = leaf(expert_input)
        with clock("experts"):
            expert_output = layer.experts(expert_in, counts)
        expert_out = leaf(expert_output)
        with clock("unpermute"):
            out = layer.dispatcher.combine(expert_out)
        # backward, last part first, each from the gradient its output got
        with clock("unpermute"):
            out.backward(torch.ones_like(out))
        with clock("experts"):
            expert_output.backward(expert_out.grad)
        with clock("permute"):
            expert_input.backward(expert_in.grad)
        with clock("router"):
            probs.backward(probs_d.grad)
        layer.zero_grad(set_to_none=True)
    # each part ran twice a round (forward, backward): pair them up, drop the warm-up
    per_layer = {
        n: statistics.median(f + b for f, b in zip(v[2::2], v[3::2], strict=True))
        for n, v in seconds.items()
    }
    dispatch = per_layer["router"] + per_layer["permute"] + per_layer["unpermute"]
    step = len(layers) * (dispatch + per_layer["experts"])
    return {
        "method": "one MoE layer of ours on a step's tokens, forward + backward of each part "
        f"apart, median of {repeats}; x {len(layers)} MoE layers for a step",
        "ms_per_layer": {n: round(v * 1e3, 3) for n, v in per_layer.items()},
        "dispatch_ms_per_layer": round(dispatch * 1e3, 3),
        "dispatch_over_experts": dispatch / per_layer["experts"],
        "moe_layers": len(layers),
        "dispatch_ms_per_step": round(len(layers) * dispatch * 1e3, 2),
        "experts_ms_per_step": round(len(layers) * per_layer["experts"] * 1e3, 2),
        "dispatch_share_of_step": len(layers) * dispatch / step_seconds,
        "moe_share_of_step": step / step_seconds,
        "grouped_gemm": bool(
            layer.experts.grouped
            and moe_grouped_gemm_available(x, layer.experts.weight1, layer.experts.weight2)
        ),
    }


def start_from_hf(run, hf: "HFTrainer", hf_dir: Path) -> dict:
    """Our model `run` takes the weights of HF's (`hf`), saved to `hf_dir` and read as `megatrain
    run --load-hf` reads them, with HF's zero router correction bias first perturbed (on both:
    a zero bias routes by the scores alone); the two models' logits on one batch are compared
    (max |difference|), so both sides start from the very same model."""
    from megatrain.checkpoint.dcp import module_of
    from megatrain.hf.layout_load import load_hf

    with torch.no_grad():
        for name, buffer in hf.model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.randn(buffer.shape, generator=torch.Generator().manual_seed(0)))
    hf.model.save_pretrained(hf_dir)
    load_hf(run, hf_dir)
    tokens = torch.randint(1, VOCAB, (2, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        theirs = hf.model(input_ids=tokens, use_cache=False).logits
        ours = module_of(run.chunks[0])(tokens).transpose(0, 1)  # [s, b, v] -> [b, s, v]
    return {
        "how": "HF's model saved (save_pretrained) and read by megatrain.hf.layout_load.load_hf",
        "max_abs_logit_difference": float((ours - theirs).abs().max()),
    }


def loader(corpus: Path, vocab_size: int, seq: int, batch: int, seed: int):
    """A GPTBatches of one microbatch per step over the train split: built twice with the same
    seed, it gives the second model the very batches `build_run` gives ours."""
    return GPTBatches(
        open_corpus(corpus, "train", vocab_size=vocab_size),
        seq_len=seq,
        seed=seed,
        global_batch_size=batch,
        micro_batch_size=batch,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench-results/gpt_train.json"))
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument(
        "--block", type=int, default=5, help="timed steps of one model before switching"
    )
    parser.add_argument(
        "--profile", action="store_true", help="after timing, profile one more step of each"
    )
    parser.add_argument(
        "--model",
        choices=("gpt", "llama", "mixtral", "gpt-oss", "deepseek"),
        default="gpt",
        help="GPT-2 beside GPT2LMHeadModel, a Llama beside LlamaForCausalLM, a mixture of "
        "experts beside MixtralForCausalLM (GptOssForCausalLM), or a DeepSeek-V3 beside "
        "DeepseekV3ForCausalLM",
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.FIELD=VALUE",
        help="a config override for our side, e.g. training.gradient_accumulation_fusion=true",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    import transformers

    extra = 1 if args.profile else 0
    iters = args.warmup + args.steps + extra
    tmp = tempfile.TemporaryDirectory(prefix="bench_gpt_train_")
    work = Path(tmp.name)
    rng = np.random.default_rng(args.seed)
    need = int(iters * BATCH * SEQ * 1.1) + 2 * SEQ  # one epoch covers every step
    corpus = write_corpus(
        work / "corpus",
        {"train": [random_docs(rng, need)], "valid": [random_docs(rng, 4 * SEQ)]},
        batch_rows=SHARD_BATCH_ROWS,
        vocab_size=VOCAB,
    )
    config = load_config(
        None,
        [
            f"model.num_layers={LAYERS}",
            f"model.hidden_size={HIDDEN}",
            f"model.num_attention_heads={HEADS}",
            f"model.max_position_embeddings={SEQ}",
            f"model.vocab_size={VOCAB}",
            "model.hidden_dropout=0.0",
            "model.attention_dropout=0.0",
            f"training.seq_length={SEQ}",
            f"training.micro_batch_size={BATCH}",
            f"training.global_batch_size={BATCH}",
            f"training.train_iters={iters}",
            'training.precision="fp32"',
            f"training.seed={args.seed}",
            f'training.output_dir="{work / "run"}"',
            f'data.corpus="{corpus}"',
            "logging.tensorboard=false",
            *OVERRIDES.get(args.model, []),
            *args.set,
        ],
    )

    load_before = os.getloadavg()
    steal_before = cpu_steal_seconds()
    dist.init_process_group(
        "gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{free_port()}"
    )
    try:
        run = build_run(config, torch.device("cpu"))
        hf_batches = loader(corpus, VOCAB, SEQ, BATCH, args.seed)
        # DeepSeek's experts as HF's exactness tests run them (eager); the others at HF's default.
        experts = "eager" if args.model == "deepseek" else None
        vocab = run.model_config.vocab_size
        hf = HFTrainer(config, hf_batches, args.seed, vocab_size=vocab, experts=experts)
        same_weights = None
        if args.model == "deepseek":  # ours starts from HF's weights, read from its files
            same_weights = start_from_hf(run, hf, work / "hf")
        peaks = [measured_matmul_tflops()]
        flops = gpt_model_flops_per_iteration(run.model_config, BATCH, SEQ)  # no recompute: = HFU

        # Both loaders are GPTBatches over one corpus and seed; check every step's batch agrees.
        run.train_data = Recorder(run.train_data)
        hf.batches = Recorder(hf.batches)

        times = {"megatrain": [], "hf": []}
        losses = {"megatrain": [], "hf": []}
        # Minor page faults and system CPU seconds of the timed steps: the cost of fresh memory.
        faults = {"megatrain": [0, 0.0], "hf": [0, 0.0]}
        steps = {"megatrain": lambda: train_step(run), "hf": hf.step}

        def timed(name: str, count: int, keep: bool) -> None:
            for _ in range(count):
                usage = resource.getrusage(resource.RUSAGE_SELF)
                start = time.perf_counter()
                out = steps[name]()
                elapsed = time.perf_counter() - start
                after = resource.getrusage(resource.RUSAGE_SELF)
                losses[name].append(out["loss"])
                if keep:
                    times[name].append(elapsed)
                    faults[name][0] += after.ru_minflt - usage.ru_minflt
                    faults[name][1] += after.ru_stime - usage.ru_stime
            label = "warm-up" if not keep else f"{len(times[name])}/{args.steps} timed"
            print(
                f"{name:9s} {count} steps ({label}): loss "
                + " ".join(f"{x:.4f}" for x in losses[name][-count:]),
                flush=True,
            )

        timed("megatrain", args.warmup, keep=False)
        timed("hf", args.warmup, keep=False)
        pattern = ("hf", "megatrain", "megatrain", "hf")
        block = 0
        while min(map(len, times.values())) < args.steps:
            name = pattern[block % 4]
            timed(name, min(args.block, args.steps - len(times[name])), keep=True)
            block += 1
        ours_digests, hf_digests = run.train_data.digests, hf.batches.digests
        if ours_digests != hf_digests:
            raise RuntimeError("the two models were trained on different batches")
        dispatch = None
        if args.model in ("mixtral", "gpt-oss", "deepseek"):
            dispatch = moe_dispatch_cost(run, statistics.median(times["megatrain"]))
        profiles = None
        if args.profile:
            profiles = {name: profile_step(steps[name], 12) for name in steps}
        # The machine's fp32 matmul rate, measured before and after; the best is the peak.
        peaks.append(measured_matmul_tflops())
        peak = max(peaks)
        steal_after = cpu_steal_seconds()

        ours_params = sum(
            p.numel() for p in dict.fromkeys(p for c in run.chunks for p in c.parameters())
        )
        hf_params = sum(p.numel() for p in hf.params)
        results = {
            name: summarize(times[name], losses[name], flops, peak) for name in ("megatrain", "hf")
        }
        m, h = results["megatrain"], results["hf"]
        for name, (minflt, stime) in faults.items():
            results[name]["minor_page_faults_per_step"] = minflt / args.steps
            results[name]["system_cpu_s_per_step"] = stime / args.steps
        results["megatrain"]["parameters"] = ours_params
        results["hf"]["parameters"] = hf_params
        results["hf"]["attn_implementation"] = hf.attn_implementation
        if hf.experts_implementation is not None:
            results["hf"]["experts_implementation"] = hf.experts_implementation
        ratio = results["megatrain"]["tokens_per_s_median"] / results["hf"]["tokens_per_s_median"]
        ratio_mean = m["tokens_per_s_mean"] / h["tokens_per_s_mean"]
        ratio_best = m["tokens_per_s_best"] / h["tokens_per_s_best"]
        record = {
            "benchmark": f"{args.model}_train",
            "machine": {
                "platform": platform.platform(),
                "cpu": cpu_model(),
                "cpus": len(os.sched_getaffinity(0)),
                "torch_threads": torch.get_num_threads(),
                "torch": torch.__version__,
                "transformers": transformers.__version__,
                "python": platform.python_version(),
                # Others on the cores: the 1/5/15-minute load before starting, and the CPU
                # seconds a hypervisor took from this VM while the benchmark ran.
                "loadavg_before": load_before,
                "loadavg_after": os.getloadavg(),  # uptime's, as the steps ended
                "cpu_steal_s_during_run": None
                if steal_before is None or steal_after is None
                else steal_after - steal_before,
            },
            "shape": {
                "num_layers": LAYERS,
                "hidden_size": HIDDEN,
                "num_attention_heads": HEADS,
                "num_query_groups": config.model.num_query_groups or HEADS,
                "ffn_hidden_size": config.ffn_hidden_size,
                "num_moe_experts": config.model.num_moe_experts,
                "moe_router_topk": config.model.moe_router_topk
                if config.model.num_moe_experts
                else None,
                "kind": args.model,
                "seq_length": SEQ,
                "vocab_size": run.model_config.vocab_size,
                "micro_batch_size": BATCH,
                "global_batch_size": BATCH,
                "precision": "fp32",
                "dropout": 0.0,
                "tokens_per_step": BATCH * SEQ,
            },
            "method": {
                "warmup_steps": args.warmup,
                "timed_steps": args.steps,
                "block": args.block,
                "order": f"warm-up ours x{args.warmup}, HF x{args.warmup}; then timed blocks "
                f"of {args.block} steps: HF, ours, ours, HF, HF, ...",
                "ours": "megatrain.run.step.train_step(build_run(config)), 1-process gloo group",
                "ours_overrides": args.set,
                "hf": f"{type(hf.model).__name__} ({hf.attn_implementation}"
                + (f", experts {hf.experts_implementation}" if hf.experts_implementation else "")
                + ") + AdamW (decay on 2-D params) + "
                "clip_grad_norm_ 1.0, same lr schedule; loss = F.cross_entropy(logits, our "
                "loader's labels)",
                "batches": "identical: two GPTBatches over the same synthetic corpus and seed; "
                f"the digests of all {len(ours_digests)} batches of each model were compared",
                "flops_per_step": flops,
                "flops_formula": "gpt_model_flops_per_iteration (72 B s l h^2 (1 + s/6h + V/12lh)"
                " for GPT-2; a Llama's K/V and SwiGLU counted as they are), both models; no "
                "recompute, so HFU = MFU",
                "peak_tflops": peak,
                "peak_tflops_measurements": peaks,
                "peak_source": "megatrain.run.metrics.measured_matmul_tflops(): fp32 2048^3 "
                f"matmul, {torch.get_num_threads()} threads",
            },
            "num_parameters_formula": gpt_parameters(run.model_config),
            "first_loss": {"megatrain": losses["megatrain"][0], "hf": losses["hf"][0]},
            "ln_vocab": math.log(VOCAB),
            "megatrain": results["megatrain"],
            "hf": results["hf"],
            "ratio_tokens_per_s_ours_over_hf": ratio,
            "ratio_tokens_per_s_mean_ours_over_hf": ratio_mean,
            "ratio_tokens_per_s_best_ours_over_hf": ratio_best,
        }
        if dispatch is not None:
            record["moe_dispatch"] = dispatch
        if same_weights is not None:
            record["same_weights"] = same_weights
        if profiles is not None:
            record["profile_top_self_cpu"] = profiles
    finally:
        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
        dist.destroy_process_group()
        tmp.cleanup()

    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    name = {"gpt": "GPT-2", "llama": "Llama", "mixtral": "Mixtral"}.get(args.model, args.model)
    print(
        f"\n{name} "
        f"{LAYERS}x{HIDDEN}, {HEADS} heads, "
        f"seq {SEQ}, vocab {VOCAB}, batch {BATCH}, fp32, "
        f"{torch.get_num_threads()} threads on {cpu_model()}; peak (measured fp32 matmul) "
        f"{peak:.3f} TFLOP/s (best of {', '.join(f'{x:.3f}' for x in peaks)})"
    )
    for name, r in (("megatrain", m), ("hf", h)):
        print(
            f"  {name:9s}: {r['tokens_per_s_median']:8.0f} tokens/s"
            f" (mean {r['tokens_per_s_mean']:.0f}, best {r['tokens_per_s_best']:.0f})"
            f" | {r['ms_per_step_median']:7.1f} ms/step | {r['model_tflops']:.3f} TFLOP/s"
            f" | MFU {r['mfu']:.1%} | {r['parameters']:,} params | first loss {r['losses'][0]:.4f}"
        )
    print(
        f"  ours / HF tokens/s: {ratio:.3f} (median), {ratio_mean:.3f} (mean), "
        f"{ratio_best:.3f} (best step); load average before {load_before[0]:.1f}"
    )
    if dispatch is not None:
        d = dispatch
        print(
            f"  dispatch (router + permute + unpermute): {d['dispatch_ms_per_layer']:.1f} ms a "
            f"layer against the experts' {d['ms_per_layer']['experts']:.1f} ms "
            f"({d['dispatch_over_experts']:.2f}x); {d['dispatch_ms_per_step']:.0f} ms of a "
            f"{m['ms_per_step_median']:.0f} ms step ({d['dispatch_share_of_step']:.1%})"
        )
    if profiles is not None:
        for name, rows in profiles.items():
            print(f"  top self-CPU ops, {name}:")
            for row in rows[:8]:
                print(f"    {row['self_ms']:8.1f} ms {row['share']:6.1%}  {row['op']}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
