"""One iteration and one evaluation: microbatches through the pipeline schedule, the
optimizer step, the learning rate of the schedule.
"""

from functools import partial

import torch
import torch.distributed as dist

from megacore import parallel_state as ps
from megacore import pipeline_parallel as pipe
from megatrain.config import Config
from megatrain.models import moe
from megatrain.models.mtp import mtp_targets
from megatrain.parallelize import (
    aux_loss_over_layout,
    split_batch_for_context_parallel,
    sum_expert_loads,
)
from megatrain.run.lr_schedule import learning_rate
from megatrain.run.setup import Run, batches_for


def to_device(batch: dict, device: torch.device) -> dict:
    """A microbatch's arrays as tensors on `device`; BERT's loss_mask stays on the CPU, where
    the model finds the positions it selects without a host sync."""
    out = {}
    bert = "mlm_labels" in batch
    for name, array in batch.items():
        tensor = torch.as_tensor(array)
        keep = bert and name == "loss_mask"
        out[name] = tensor if keep else tensor.to(device, non_blocking=True)
    return out


def microbatches(run: Run, source) -> list[dict]:
    """The next `run.num_microbatches` microbatches of `source` on the run's device, each with
    multi-token prediction's shifted tokens, targets and mask when the model has MTP
    (`mtp.mtp_targets`, made from the whole sequence before any context-parallel split)."""
    depth = run.model_config.mtp_num_layers
    out = [to_device(next(source), run.device) for _ in range(run.num_microbatches)]
    return [mtp_targets(b, depth) for b in out] if depth else out


def _forward_step(data_iterator, model, mtp_loss_scale: float = 0.0):
    batch = next(data_iterator)
    if "labels" in batch:  # GPT; packed documents: their positions, documents, loss mask
        cp = ps.get_context_parallel_world_size()
        if cp > 1:  # this rank's two chunks of each sequence, with their global positions
            batch = split_batch_for_context_parallel(batch, ps.get_context_parallel_rank(), cp)
        documents = {k: batch[k] for k in ("position_ids", "segments") if k in batch}
        mtp = {k: batch[k] for k in ("mtp_tokens", "mtp_labels") if k in batch}
        output = model(batch["tokens"], batch["labels"], **documents, **mtp)
        if "loss_mask" in batch or mtp:
            masks = (batch.get("loss_mask"), batch.get("mtp_mask"))
            return output, partial(gpt_loss, *masks, mtp_loss_scale, cp)
    else:  # BERT
        output = model(
            batch["tokens"],
            batch["token_types"],
            batch["padding_mask"],
            batch["mlm_labels"],
            batch["loss_mask"],
            batch["sop_labels"],
        )

    def loss_func(output):
        if isinstance(output, dict):  # BERT's last stage: its losses, logged apart
            return output["loss"], {k: v.detach() for k, v in output.items()}
        loss = output.float().mean()  # GPT's last stage: the loss per token
        return loss, {"loss": loss.detach()}

    return output, loss_func


def gpt_loss(
    loss_mask: torch.Tensor | None,
    mtp_mask: torch.Tensor | None,
    mtp_loss_scale: float,
    cp: int,
    output: torch.Tensor | dict,
):
    """A GPT microbatch's loss from the model's loss per token: the mean over the tokens
    `loss_mask` keeps (data.eod_mask_loss; None: all), plus with multi-token prediction
    (`output` {"lm", "mtp"}) mtp_loss_scale / D times the sum of each depth's mean over the
    targets its column of `mtp_mask` keeps.  Every mean is over the microbatch's count of
    kept targets, never a rank's: under context parallelism each rank holds part of the
    microbatch and takes its sum over the microbatch's count (all-reduced over CP, one
    all-reduce for every count), times cp, so that the gradients' mean over the CP ranks (the
    data-parallel reduction includes them) and the logged mean are the microbatch's mean (the
    L of megacore.moe's gradient-scale rule); the microbatches' and the DP ranks' means are
    then averaged as the main loss's, which is what one process computes.  Logged: "loss"
    (the LM loss alone) and "mtp_loss/depth<k>"."""
    lm, mtp = (output["lm"], output["mtp"]) if isinstance(output, dict) else (output, None)
    values, masks = [], []
    if loss_mask is not None:
        values.append(lm.float())
        masks.append(loss_mask.float())
    if mtp is not None:
        values += list(mtp.float().unbind(-1))
        masks += list(mtp_mask.float().unbind(-1))
    counts = torch.stack([m.sum() for m in masks])
    if cp > 1:
        dist.all_reduce(counts, group=ps.get_context_parallel_group())
    means = [
        (v * m).sum() * cp / c.clamp(min=1) for v, m, c in zip(values, masks, counts, strict=True)
    ]
    loss = means.pop(0) if loss_mask is not None else lm.float().mean()
    stats = {"loss": loss.detach()}
    if mtp is not None:
        stats.update({f"mtp_loss/depth{k + 1}": m.detach() for k, m in enumerate(means)})
        loss = loss + mtp_loss_scale / len(means) * torch.stack(means).sum()
    return loss, stats


def forward_backward(
    run: Run,
    microbatches: list,
    forward_only: bool = False,
    forward_step=None,
    names: tuple[str, ...] | None = None,
    read: bool = True,
) -> dict | torch.Tensor:
    """Run one global batch through the pipeline; return its mean loss and the model's other
    statistics ({"loss": ..., BERT: "mlm_loss", "sop_loss", "sop_accuracy"}), as floats on
    every rank (`read=False`: as one device tensor in `names`' order, not read yet).
    `forward_step` and the statistics' `names` default to the model kind's (a fine-tuning
    task brings its own)."""
    t = run.config.training
    interleaved = len(run.chunks) > 1
    mtp_scale = run.model_config.mtp_loss_scaling_factor
    infos = pipe.get_forward_backward_func(run.config.parallel.pipeline_schedule)(
        forward_step_func=forward_step or partial(_forward_step, mtp_loss_scale=mtp_scale),
        data_iterator=[iter(microbatches) for _ in run.chunks]
        if interleaved
        else iter(microbatches),
        model=run.chunks if interleaved else run.chunks[0],
        num_microbatches=len(microbatches),
        seq_length=t.seq_length // ps.get_context_parallel_world_size(),
        micro_batch_size=t.micro_batch_size,
        hidden_size=run.model_config.hidden_size,
        dtype=run.dtype,
        sequence_parallel=run.model_config.sequence_parallel,
        forward_only=forward_only,
        grad_scale_func=None if forward_only else run.optimizer.scale_loss,
        finalize_model_grads_func=None if forward_only else pipe.finalize_model_grads,
    )
    # The last stage holds the losses: average over DP (and CP: each CP rank's loss is its
    # part's, scaled so that their mean is the microbatch's), then share over the pipeline.
    names = names or statistic_names(run)
    total = torch.zeros(len(names), device=run.device)
    if infos:
        total += torch.stack([torch.stack([i[n].float() for n in names]) for i in infos]).mean(0)
        dist.all_reduce(total, group=ps.get_data_parallel_group(with_context_parallel=True))
        total /= ps.get_data_parallel_world_size(with_context_parallel=True)
    if ps.get_pipeline_model_parallel_world_size() > 1:
        dist.all_reduce(total, group=ps.get_pipeline_model_parallel_group())
    return dict(zip(names, total.tolist(), strict=True)) if read else total


# What each model's last stage reports per microbatch ("loss" is what is trained).
STATISTICS = {
    "gpt": ("loss",),
    "llama": ("loss",),
    "bert": ("loss", "mlm_loss", "sop_loss", "sop_accuracy"),
}


def statistic_names(run: Run) -> tuple[str, ...]:
    """What the run's last stage reports per microbatch: its kind's `STATISTICS`, and each
    multi-token prediction depth's loss ("mtp_loss/depth<k>"; "loss" is then the LM loss)."""
    depth = run.model_config.mtp_num_layers or 0
    return STATISTICS[run.kind] + tuple(f"mtp_loss/depth{k}" for k in range(1, depth + 1))


def evaluate(run: Run, statistics: bool = False) -> float | dict:
    """Mean loss over `eval_iters` global batches of the valid split, always from its start
    (with `statistics`, every statistic of `forward_backward`, averaged)."""
    t = run.config.training
    batches = batches_for(run.config, run.valid_data, run.dp_size)
    for c in run.chunks:
        c.eval()
    results = []
    with torch.no_grad():
        for _ in range(t.eval_iters):
            micro = microbatches(run, batches)
            results.append(forward_backward(run, micro, forward_only=True))
    for c in run.chunks:
        c.train()
    mean = {k: sum(r[k] for r in results) / len(results) for k in results[0]}
    return mean if statistics else mean["loss"]


def lr_for(config: Config, iteration: int) -> float:
    """The configured schedule's learning rate at `iteration`."""
    o = config.optimizer
    return learning_rate(
        iteration,
        lr=o.lr,
        min_lr=o.min_lr,
        warmup_iters=o.lr_warmup_iters,
        decay_iters=o.lr_decay_iters or config.training.train_iters,
        style=o.lr_decay_style,
    )


def train_step(run: Run, stop_flag: torch.Tensor | None = None) -> dict:
    """One iteration; returns its loss, grad norm and learning rate.

    With `training.one_sync_per_iteration` the loss, the optimizer's norm and inf/nan flag,
    and `stop_flag` (the loop's stop agreement, already all-reduced; returned as "stop") stay
    on the device until one read at the end; otherwise each is read where it is made."""
    lr = lr_for(run.config, run.iteration)
    for group in run.optimizer.param_groups:
        group["lr"] = lr
    micro = microbatches(run, run.train_data)
    # MoE: the auxiliary losses' gradients scaled as the main loss's (1 / microbatches, x the
    # fp16 loss scale), each layer's load counted from zero.  Times cp: a CP rank's aux and z
    # losses are its share of its sequences' (the shares add up over the CP ranks), while the
    # data-parallel reduction averages the gradients over them.  Part of megacore.moe's
    # gradient-scale rule (its module docstring): the x cp undoes the DDP's 1/cp.
    one = torch.ones((), device=run.device)
    cp = ps.get_context_parallel_world_size()
    moe.begin_step(run.chunks, run.optimizer.scale_loss(one) / run.num_microbatches * cp)
    if run.config.training.one_sync_per_iteration:
        totals = forward_backward(run, micro, read=False)
        parts = [totals, run.optimizer.step_on_device()]
        if stop_flag is not None:
            parts.append(stop_flag.to(totals.device, totals.dtype))
        aux = aux_loss_over_layout(run.chunks, run.model_config, run.device)
        if aux is not None:
            parts.append(aux.to(totals.device, totals.dtype).view(1))
        values = torch.cat(parts).tolist()  # the iteration's one host sync
        names = statistic_names(run)
        stats = dict(zip(names, values[: len(names)], strict=True))
        ok, grad_norm, _ = run.optimizer.settle_step(*values[len(names) : len(names) + 2])
        if stop_flag is not None:
            stats["stop"] = values[len(names) + 2]
        if aux is not None:
            stats["moe_aux_loss"] = values[-1]
    else:
        stats = forward_backward(run, micro)
        ok, grad_norm, _ = run.optimizer.step()
        if stop_flag is not None:
            stats["stop"] = stop_flag.item()
        aux = aux_loss_over_layout(run.chunks, run.model_config, run.device)
        if aux is not None:  # the load-balancing loss without its coefficient, one process's
            stats["moe_aux_loss"] = aux.item()
    # DeepSeek-V3's expert bias moves once per optimizer step, by the step's token counts
    # (every rank's of the stage: the bias stays the same everywhere, as one process's).
    sum_expert_loads(run.chunks)
    moe.update_expert_biases(run.chunks, run.model_config.moe_router_bias_update_rate)
    run.optimizer.zero_grad()
    run.iteration += 1
    return {**stats, "lr": lr, "grad_norm": grad_norm, "ok": ok}
