"""megatron-core's own GPTModel, trained the way Megatron-LM trains it on one GPU.

The model is `megatron.core.models.gpt.GPTModel` with `get_gpt_layer_local_spec()`: megatron's
own modules, no Transformer Engine (ColumnParallelLinear and RowParallelLinear at tp 1,
DotProductAttention with its unfused softmax over the s x s scores, torch's LayerNorm or
RMSNorm).  Of the fusions Megatron-LM turns on by default, those that need neither Apex nor TE
are on (bias-GeLU or bias-SwiGLU and bias-dropout-add, which megatron's `jit_fuser` hands to
torch.compile: the warm-up steps compile them); the masked softmax, the gradient accumulation
fusion and the fused RoPE need compiled extensions and are off.  As
Megatron-LM's pretrain_gpt.py: `parallel_state.initialize_model_parallel(1, 1)` on the
1-process group bench_gpu.py made, `model_parallel_cuda_manual_seed`, `Float16Module` for bf16,
`DistributedDataParallel` with fp32 gradient buffers, `get_megatron_optimizer`'s Adam (torch's
AdamW without TE or Apex; bf16 parameters with fp32 main parameters,
Float16OptimizerWithFloat16Params), one microbatch through `get_forward_backward_func()` with
`finalize_model_grads`, the loss GPTModel's per-token cross entropy against the batch's labels,
averaged.  Our config gives the shape (padded vocabulary, GPT-2's tied or Llama's untied output
layer, GQA, SwiGLU, RoPE and its scaling), dropout, recompute (full: every layer, uniform 1;
selective: the attention core), Adam's betas, eps and weight decay (not on biases and norms,
megatron's default as ours), clipping, and the learning rate of each step (ours, `lr_for`).

On a CPU (bench_gpu.py --small, the tests) megatron-core's hard-wired CUDA calls (buffers made
on `torch.cuda.current_device()`, `device="cuda"` tensors, the CUDA RNG tracker, streams) go to
the CPU through `cpu_stand_in`, so the same code runs there in fp32 or bf16 on gloo; its CPU
timings include that stand-in's per-op hook and are no speed measurement.
"""

import contextlib
import logging
from importlib.metadata import version
from unittest import mock

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from megatrain.run.step import lr_for
from peers import Trainer


def build(config, model_config, batches, device: torch.device, precision: str, seed: int):
    stand_in = cpu_stand_in if device.type == "cpu" else contextlib.nullcontext
    with stand_in():
        return _build(config, model_config, batches, device, precision, seed, stand_in)


def _build(config, m, batches, device, precision, seed, stand_in) -> Trainer:
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.module import Float16Module

    o, t = config.optimizer, config.training
    bf16 = precision == "bf16"
    dtype = torch.bfloat16 if bf16 else torch.float32
    llama = m.normalization == "rmsnorm"
    recompute = {
        "full": {"recompute_granularity": "full", "recompute_method": "uniform",
                 "recompute_num_layers": 1},
        "selective": {"recompute_granularity": "selective", "recompute_modules": ["core_attn"]},
        "none": {},
    }[m.recompute]  # fmt: skip
    positions = "rope" if m.position_embedding == "rope" else "learned_absolute"
    parallel_state.initialize_model_parallel(1, 1)
    try:
        torch.manual_seed(seed)
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
        mc = TransformerConfig(
            num_layers=m.num_layers,
            hidden_size=m.hidden_size,
            num_attention_heads=m.num_attention_heads,
            num_query_groups=m.num_query_groups,
            ffn_hidden_size=m.ffn_hidden_size,
            hidden_dropout=m.hidden_dropout,
            attention_dropout=m.attention_dropout,
            init_method_std=m.init_method_std,
            layernorm_epsilon=m.layernorm_epsilon,
            normalization="RMSNorm" if llama else "LayerNorm",
            add_bias_linear=m.add_bias,
            gated_linear_unit=m.swiglu,
            activation_func=F.silu if m.swiglu else F.gelu,  # fused: bias_gelu is tanh GeLU
            bias_activation_fusion=True,
            bias_dropout_fusion=True,
            masked_softmax_fusion=False,
            gradient_accumulation_fusion=False,
            apply_rope_fusion=False,
            params_dtype=dtype,
            pipeline_dtype=dtype,
            bf16=bf16,
            use_cpu_initialization=device.type == "cpu",
            **recompute,
        )
        model = GPTModel(
            mc,
            get_gpt_layer_local_spec(normalization=mc.normalization),
            vocab_size=m.vocab_size,
            max_sequence_length=t.seq_length,
            share_embeddings_and_output_weights=m.tie_output,
            position_embedding_type=positions,
            rotary_base=int(m.rotary_base),
            rope_scaling=m.rope_scaling is not None,
            rope_scaling_factor=m.rope_scaling[0] if m.rope_scaling else 8.0,
        )
        parameters = sum(p.numel() for p in model.parameters())
        if bf16:
            model = Float16Module(mc, model)
        ddp = DistributedDataParallel(
            mc, DistributedDataParallelConfig(grad_reduce_in_fp32=bf16), model
        )
        optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam",
                lr=o.lr,
                min_lr=o.min_lr,
                weight_decay=o.weight_decay,
                adam_beta1=o.adam_beta1,
                adam_beta2=o.adam_beta2,
                adam_eps=o.adam_eps,
                clip_grad=o.clip_grad,
                bf16=bf16,
                params_dtype=dtype,
            ),
            [ddp],
        )
    except BaseException:
        parallel_state.destroy_model_parallel()
        raise
    mc.grad_scale_func = optimizer.scale_loss
    mc.finalize_model_grads_func = finalize_model_grads
    forward_backward = get_forward_backward_func()
    seq, micro = t.seq_length, t.micro_batch_size
    position_ids = torch.arange(seq, device=device).expand(micro, seq)
    iteration = 0

    def forward_step(data_iterator, model):
        tokens, labels = next(data_iterator)
        # attention_mask None: the causal mask is made inside (AttnMaskType.causal)
        output = model(tokens, position_ids, None, labels=labels)  # per-token loss [b, s]

        def loss_func(output):
            loss = output.float().mean()
            return loss, {"loss": loss.detach()}

        return output, loss_func

    def step() -> dict:
        nonlocal iteration
        lr = lr_for(config, iteration)
        for group in optimizer.param_groups:
            group["lr"] = lr
        batch = next(batches)
        tokens = torch.as_tensor(batch["tokens"], dtype=torch.long).to(device)
        labels = torch.as_tensor(batch["labels"], dtype=torch.long).to(device)
        with stand_in():
            ddp.zero_grad_buffer()
            optimizer.zero_grad()
            (stats,) = forward_backward(
                forward_step_func=forward_step,
                data_iterator=iter([(tokens, labels)]),
                model=[ddp],
                num_microbatches=1,
                seq_length=seq,
                micro_batch_size=micro,
                forward_only=False,
            )
            ok, grad_norm, _ = optimizer.step()
        iteration += 1
        return {"loss": stats["loss"].item(), "lr": lr, "grad_norm": grad_norm, "ok": ok}

    def close() -> None:
        nonlocal ddp, optimizer, model
        ddp = optimizer = model = None
        parallel_state.destroy_model_parallel()

    inner = [type(x).__name__ for x in getattr(optimizer, "chained_optimizers", [optimizer])]
    shape = "Llama (RMSNorm, SwiGLU, RoPE, GQA, untied)" if llama else "GPT-2"
    return Trainer(
        step=step,
        close=close,
        parameters=parameters,
        model_config=m,
        recompute=m.recompute,
        precision="bf16 parameters, fp32 main parameters (Float16OptimizerWithFloat16Params)"
        if bf16
        else "fp32",
        description=(
            f"megatron-core {version('megatron-core')} GPTModel ({shape}) with the local layer "
            "spec (no Transformer Engine; DotProductAttention, unfused softmax), "
            f"{'Float16Module, ' if bf16 else ''}DistributedDataParallel, get_megatron_optimizer "
            f"Adam ({', '.join(inner)} over torch.optim.AdamW), forward_backward_no_pipelining; "
            f"recompute {m.recompute}; lr from our schedule each step"
            + ("; on the CPU through cpu_stand_in" if device.type == "cpu" else "")
        ),
        details={
            "layer_spec": "local (get_gpt_layer_local_spec), not Transformer Engine",
            "version": version("megatron-core"),
            "model_class": "GPTModel (0.19 logs it as deprecated in favour of HybridModel)",
            "optimizer": inner,
            "fusions": "bias_activation_fusion, bias_dropout_fusion on (torch.compile); "
            "masked_softmax_fusion, gradient_accumulation_fusion, apply_rope_fusion off (need "
            "Apex or TE kernels)",
        },
    )


def _is_cuda(device) -> bool:
    if isinstance(device, int):  # torch.cuda.current_device() below
        return True
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


class _CudaToCpu(TorchFunctionMode):
    """Tensors asked for on a CUDA device are made on the CPU; `Tensor.type()` answers with the
    CUDA type name megatron's bf16 optimizer checks its parameters against."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.to:
            args = tuple("cpu" if _is_cuda(a) and not isinstance(a, int) else a for a in args)
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            return func(*args).replace("torch.", "torch.cuda.", 1)
        return func(*args, **kwargs)


class _NoStream:
    def wait_stream(self, other) -> None:
        pass

    def wait_event(self, event) -> None:
        pass


@contextlib.contextmanager
def cpu_stand_in():
    """megatron-core on a machine without CUDA: its CUDA device, RNG and streams on the CPU.

    `torch.cuda.current_device()` answers 0 and every tensor asked for on a CUDA device is
    made on the CPU (`_CudaToCpu`); the CUDA RNG calls of megatron's RNG tracker use the CPU
    generator, so dropout and recompute draw as on a GPU from their own states; streams are
    no-ops.  A TorchFunctionMode is off while autograd runs backward, so megatron's
    recompute (CheckpointFunction.backward, which runs the forward again) enters it anew.
    """
    import megatron.core.tensor_parallel.random as mrandom

    checkpoint_backward = mrandom.CheckpointFunction.backward

    def backward(ctx, *grads):
        with _CudaToCpu():
            return checkpoint_backward(ctx, *grads)

    def cpu_rng_state(*args, **kwargs):
        return torch.get_rng_state()

    def set_cpu_rng_state(state, *args, **kwargs):
        torch.set_rng_state(state)

    # The tracker warns whenever the CPU generator moved inside a fork: here it always does.
    logging.getLogger(mrandom.__name__).setLevel(logging.ERROR)
    patches = [
        mock.patch("torch.cuda.current_device", return_value=0),
        mock.patch("torch.cuda.current_stream", return_value=_NoStream()),
        mock.patch("torch.cuda.get_rng_state", cpu_rng_state),
        mock.patch("torch.cuda.set_rng_state", set_cpu_rng_state),
        mock.patch("torch.cuda.manual_seed", torch.manual_seed),
        mock.patch.object(mrandom, "_get_cuda_rng_state", cpu_rng_state),
        mock.patch.object(mrandom, "_set_cuda_rng_state", set_cpu_rng_state),
        mock.patch.object(mrandom.CheckpointFunction, "backward", staticmethod(backward)),
    ]
    with contextlib.ExitStack() as stack:
        for patch in patches:
            stack.enter_context(patch)
        stack.enter_context(_CudaToCpu())
        yield
