"""torchtitan's Llama 3, trained with torchtitan's own pieces as its train.py uses them on one GPU.

The model is torchtitan's `models.llama3.Transformer` (0.2.x; 0.3 needs a newer torch than
the GPU image's 2.11, see scripts/fetch_gpu_wheels.py) with SDPA attention, built on the meta
device and initialized by its `init_weights`, then `parallelize_llama` (on one device: its
activation checkpointing only; no compile, no FSDP), `build_optimizers` (AdamW, fused, weight
decay on every parameter as torchtitan applies it), `maybe_enable_amp` (on one device:
fp32 weights under torch.autocast(bf16)), `cross_entropy_loss` (a sum) over the token count,
`clip_grad_norm_`; the learning rate of each step is set from our schedule (`lr_for`), the
other hyperparameters are our config's.

For a Llama config (`model.kind = "llama"`) it is the same model: layers, hidden, heads, key/value
groups, SwiGLU width, RoPE base and scaling, padded vocabulary, untied output.  torchtitan has no
GPT-2, so for one it runs a FLOP-matched Llama, labelled so: the same layers, hidden, heads
(one key/value head each), sequence and padded vocabulary, and a SwiGLU width of 2f/3 for
GPT-2's MLP width f (three h x 2f/3 matrices for two h x f: the same matmul FLOPs per token);
RMSNorm, RoPE, no biases, an untied output layer and no dropout instead of GPT-2's LayerNorm,
learned positions, biases, tied embeddings and dropout.  Recompute maps to its activation
checkpointing: full -> "full" (every block), selective -> "selective" per-op (its save list:
matmuls and attention kept, the rest recomputed), none -> "none".
"""

import dataclasses
from contextlib import nullcontext
from importlib.metadata import version

import torch

from megatrain.run.step import lr_for
from peers import Trainer


def build(config, model_config, batches, device: torch.device, precision: str, seed: int):
    from torchtitan.components.loss import cross_entropy_loss
    from torchtitan.components.optimizer import build_optimizers
    from torchtitan.config import JobConfig
    from torchtitan.config.job_config import Optimizer as OptimizerConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.models.llama3 import Transformer, TransformerModelArgs, parallelize_llama
    from torchtitan.models.llama3.model.args import RoPEScalingArgs

    o, t, m = config.optimizer, config.training, model_config
    if m.swiglu:
        run, shape = m, "the same Llama"
    else:  # GPT-2: the Llama of the same matmul FLOPs
        ffn = round(2 * m.ffn_hidden_size / 3)
        run = dataclasses.replace(
            m, swiglu=True, ffn_hidden_size=ffn, normalization="rmsnorm", position_embedding="rope",
            add_bias=False, tie_output=False, rope_scaling=None, hidden_dropout=0.0,
            attention_dropout=0.0,
        )  # fmt: skip
        shape = (
            f"a FLOP-matched Llama standing in for GPT-2 (SwiGLU {ffn} = 2/3 x GPT-2's MLP "
            f"{m.ffn_hidden_size}; RMSNorm, RoPE, no biases, untied output, no dropout)"
        )
    h = run.hidden_size
    rope = RoPEScalingArgs(*run.rope_scaling) if run.rope_scaling else RoPEScalingArgs(1.0)
    args = TransformerModelArgs(
        dim=h,
        n_layers=run.num_layers,
        n_heads=run.num_attention_heads,
        n_kv_heads=run.num_query_groups,
        vocab_size=run.vocab_size,
        # FeedForward sizes SwiGLU from 4h: int(2 * 4h / 3) scaled, rounded up to multiple_of.
        multiple_of=run.ffn_hidden_size,
        ffn_dim_multiplier=run.ffn_hidden_size / int(8 * h / 3),
        norm_eps=run.layernorm_epsilon,
        rope_theta=run.rotary_base,
        rope_scaling_args=rope,
        max_seq_len=t.seq_length,
        attn_type="sdpa",
    )
    job = JobConfig()
    job.training.seq_len = t.seq_length
    job.activation_checkpoint.mode = m.recompute  # torchtitan's modes bear our names
    job.activation_checkpoint.selective_ac_option = "op"
    job.compile.enable = False
    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, etp=1, world_size=1)

    torch.manual_seed(seed)
    with torch.device("meta"):
        model = Transformer(args)
    parallelize_llama(model, dims, job)
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights(buffer_device=device)
    width = model.layers["0"].feed_forward.w1.out_features
    if width != run.ffn_hidden_size:
        raise RuntimeError(f"torchtitan built a SwiGLU of {width}, not {run.ffn_hidden_size}")
    model.train()
    params = list(model.parameters())
    optimizers = build_optimizers(
        [model],
        OptimizerConfig(
            name="AdamW",
            lr=o.lr,
            beta1=o.adam_beta1,
            beta2=o.adam_beta2,
            eps=o.adam_eps,
            weight_decay=o.weight_decay,
            implementation="fused",
        ),
        dims,
    )
    bf16 = precision == "bf16"
    # torchtitan's trainer enters this one context every step, as here
    amp = dist_utils.maybe_enable_amp(dims, "bfloat16", device.type) if bf16 else nullcontext()
    iteration = 0

    def step() -> dict:
        nonlocal iteration
        lr = lr_for(config, iteration)
        for optimizer in optimizers:
            for group in optimizer.param_groups:
                group["lr"] = lr
        batch = next(batches)
        tokens = torch.as_tensor(batch["tokens"], dtype=torch.long).to(device)
        labels = torch.as_tensor(batch["labels"], dtype=torch.long).to(device)
        optimizers.zero_grad()
        with amp:
            pred = model(tokens)
            loss = cross_entropy_loss(pred, labels) / labels.numel()
        del pred  # as torchtitan: the logits freed before backward
        loss.backward()
        grad_norm = dist_utils.clip_grad_norm_(params, o.clip_grad, foreach=True)
        optimizers.step()
        iteration += 1
        return {"loss": loss.item(), "lr": lr, "grad_norm": float(grad_norm)}

    def close() -> None:
        nonlocal model, optimizers, params
        model = optimizers = params = None

    return Trainer(
        step=step,
        close=close,
        parameters=sum(p.numel() for p in params),
        model_config=run,
        recompute=m.recompute,
        precision="fp32 weights, torch.autocast(bf16) (maybe_enable_amp)" if bf16 else "fp32",
        description=(
            f"torchtitan {version('torchtitan')} llama3 Transformer, {shape}; SDPA attention "
            "(cuDNN, flash, math); parallelize_llama (activation checkpointing "
            f"{m.recompute}, no compile, no FSDP), build_optimizers AdamW fused "
            "(decay on every parameter), clip_grad_norm_, cross_entropy_loss / tokens"
            f"{', maybe_enable_amp (autocast bf16)' if bf16 else ''}; lr from our schedule"
        ),
        details={
            "version": version("torchtitan"),
            "model": "same shape" if m.swiglu else "FLOP-matched Llama for GPT-2",
            "ffn_hidden_size": run.ffn_hidden_size,
            "activation_checkpoint": m.recompute,
            "attention": "sdpa",
        },
    )
