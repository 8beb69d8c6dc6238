"""The training loop of GPT and BERT: one function, `train(config)`, run by every rank.

`model.kind` picks the model, its corpus (GPT-2 BPE documents, or WordPiece with sentence
ends for BERT), its samples (`data.GPTBatches` or `bert_data.BertBatches`) and its loss
(next-token cross entropy; BERT's masked-LM plus sentence-order losses, logged apart).

Per iteration: each data-parallel rank takes its G / dp samples of the global
batch as G / (micro x dp) microbatches; the pipeline schedule of the layout
runs them forward and backward; megacore's DDP averages gradients over the
data-parallel ranks (reduce-scatter under the distributed optimizer); the
optimizer unscales, skips non-finite steps, clips to the global norm and takes
the AdamW step; the learning rate follows warm-up and decay.  The loss is the
mean over the global batch (BERT's: the mean over microbatches of each one's mean over its
predicted tokens), identical to one process over the whole batch.
"""

import dataclasses
import datetime
import json
import math
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from megacore import parallel_state as ps
from megacore import pipeline_parallel as pipe
from megacore import tensor_parallel as tp
from megacore.distributed import DistributedDataParallel
from megacore.optimizer import MegatronOptimizer, NonFiniteLossGuard, OptimizerConfig
from megatrain import checkpointing, collective_failures
from megatrain import data as data_lib
from megatrain.config import Config, validate
from megatrain.lr_schedule import learning_rate
from megatrain.metrics import RunLog, device_peak_tflops
from megatrain.models import build_model_chunks, flops_per_iteration
from megatrain.models.bert import bert_config
from megatrain.models.transformer import TransformerConfig, compile_layers

PRECISION_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def init_distributed(timeout: float | None = None) -> tuple[torch.device, bool]:
    """Join the job described by the environment (RANK, WORLD_SIZE, MASTER_ADDR, ...).

    Returns (this rank's device, whether this call created the process group).
    NCCL on GPUs, gloo on CPUs; `timeout`: seconds a collective waits (None: torch's).
    """
    cuda = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank % torch.cuda.device_count()) if cuda else None
    if cuda:
        torch.cuda.set_device(device)
    created = False
    if not dist.is_initialized():
        wait = {"timeout": datetime.timedelta(seconds=timeout)} if timeout else {}
        dist.init_process_group(
            "nccl" if cuda else "gloo", device_id=device, **_attempt_store(wait), **wait
        )
        created = True
    return device or torch.device("cpu"), created


def _attempt_store(wait: dict) -> dict:
    """The store this attempt's process group meets in, when torch's elastic agent restarted
    the workers: the agent's store outlives an attempt, and the keys the last attempt's
    ranks left there (their addresses) would send this one's connections to dead ports
    (torch issue 135712).  Each attempt gets its own key prefix; first attempts and other
    launchers use torch's own env:// store."""
    env = os.environ
    attempt = int(env.get("TORCHELASTIC_RESTART_COUNT") or 0)
    if not attempt or env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    store = dist.TCPStore(
        env["MASTER_ADDR"], int(env["MASTER_PORT"]), int(env["WORLD_SIZE"]), is_master=False,
        **wait,
    )  # fmt: skip
    return {
        "store": dist.PrefixStore(f"megatrain/attempt-{attempt}", store),
        "rank": int(env["RANK"]),
        "world_size": int(env["WORLD_SIZE"]),
    }


def model_config(config: Config, vocab_size: int) -> TransformerConfig:
    """The model of a run config; `vocab_size` is the tokenizer's, padded here for TP."""
    m, p = config.model, config.parallel
    padded = tp.vocab_size_with_padding(
        vocab_size, p.tensor_model_parallel_size, m.make_vocab_size_divisible_by
    )
    make = bert_config if m.kind == "bert" else TransformerConfig
    return make(
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        num_attention_heads=m.num_attention_heads,
        vocab_size=padded,
        max_position_embeddings=m.max_position_embeddings,
        true_vocab_size=vocab_size,
        ffn_hidden_size=config.ffn_hidden_size,
        hidden_dropout=m.hidden_dropout,
        attention_dropout=m.attention_dropout,
        init_method_std=m.init_method_std,
        layernorm_epsilon=m.layernorm_epsilon,
        recompute=m.recompute,
        distribute_saved_activations=p.distribute_saved_activations,
        sequence_parallel=p.sequence_parallel and p.tensor_model_parallel_size > 1,
        block_order=m.block_order,
    )


TOKENIZER_KINDS = {"gpt": "gpt2-bpe", "bert": "bert-wordpiece"}


def open_corpus(config: Config, split: str, verify: bool | None = None) -> "data_lib.Corpus":
    """The corpus split of a run, refused when its tokenizer or vocabulary is not the model's
    (and, when `verify` (default: data.verify_sha256), a shard whose sha256 differs)."""
    return data_lib.open_corpus(
        config.data.corpus,
        split,
        vocab_size=config.model.vocab_size or None,
        tokenizer_kind=TOKENIZER_KINDS[config.model.kind],
        tokenizer_sha256=config.data.tokenizer_sha256,
        verify_sha256=config.data.verify_sha256 if verify is None else verify,
    )


@dataclass
class Run:
    """Everything one rank holds while training."""

    config: Config
    model_config: TransformerConfig
    chunks: list
    optimizer: MegatronOptimizer
    train_data: "data_lib.GPTBatches"  # or bert_data.BertBatches
    valid_corpus: "data_lib.Corpus"
    device: torch.device
    dtype: torch.dtype
    dp_size: int
    iteration: int = 0
    history: dict = field(default_factory=lambda: {"loss": [], "valid": [], "grad_norm": []})

    @property
    def kind(self) -> str:
        return self.config.model.kind

    @property
    def num_microbatches(self) -> int:
        t = self.config.training
        return t.global_batch_size // (t.micro_batch_size * self.dp_size)


def _batches(config: Config, corpus: "data_lib.Corpus", dp: int):
    """This data-parallel rank's microbatches of a split, in the paper's order."""
    t, d = config.training, config.data
    common = {
        "seq_len": t.seq_length,
        "seed": t.seed,
        "global_batch_size": t.global_batch_size,
        "micro_batch_size": t.micro_batch_size,
        "dp_rank": ps.get_data_parallel_rank(),
        "dp_size": dp,
    }
    if config.model.kind == "bert":
        from megatrain.bert_data import BertBatches

        return BertBatches(
            corpus,
            **common,
            masked_lm_prob=d.masked_lm_prob,
            max_ngram=d.max_ngram,
            short_seq_prob=d.short_seq_prob,
        )
    return data_lib.GPTBatches(corpus, **common)


def prepare_training(
    config: Config, chunks: list, dtype: torch.dtype
) -> tuple[list, MegatronOptimizer]:
    """Model chunks ready to train as `config` says: compiled if asked, wrapped in megacore's
    DDP (or the distributed optimizer's buffers), the tensor-parallel dropout seeds set, and
    the optimizer over them.  Shared by pretraining and fine-tuning (megaeval)."""
    p, t, o = config.parallel, config.training, config.optimizer
    if t.compile:
        chunks = [compile_layers(c) for c in chunks]
    chunks = [
        DistributedDataParallel(
            c,
            grad_reduce_in_fp32=dtype != torch.float32,
            overlap_grad_reduce=p.overlap_grad_reduce,
            use_distributed_optimizer=p.use_distributed_optimizer,
            overlap_param_gather=p.overlap_param_gather,
            bucket_size=p.bucket_size,
        )
        for c in chunks
    ]
    # Dropout masks: the same on the TP ranks of a stage, different between stages.
    tp.model_parallel_manual_seed(t.seed + 100 * ps.get_pipeline_model_parallel_rank())
    optimizer = MegatronOptimizer(
        OptimizerConfig(
            lr=o.lr,
            weight_decay=o.weight_decay,
            adam_beta1=o.adam_beta1,
            adam_beta2=o.adam_beta2,
            adam_eps=o.adam_eps,
            clip_grad=o.clip_grad,
            fp16=t.precision == "fp16",
            bf16=t.precision == "bf16",
            loss_scale=o.loss_scale,
            initial_loss_scale=o.initial_loss_scale,
            min_loss_scale=o.min_loss_scale,
            loss_scale_window=o.loss_scale_window,
            hysteresis=o.hysteresis,
            use_distributed_optimizer=p.use_distributed_optimizer,
        ),
        chunks,
    )
    return chunks, optimizer


def build_run(config: Config, device: torch.device) -> Run:
    """Parallel groups, model chunks wrapped in DDP, optimizer and data for this rank."""
    dp = validate(config, dist.get_world_size())
    p, t = config.parallel, config.training
    vpp = p.virtual_pipeline_model_parallel_size
    ps.initialize_model_parallel(
        p.tensor_model_parallel_size,
        p.pipeline_model_parallel_size,
        vpp if vpp and vpp > 1 else None,
        timeout=datetime.timedelta(seconds=p.collective_timeout),
    )
    # Shards verified once per node (`megatrain run` itself verifies before its workers start
    # and hands them a config that says so).
    verify = config.data.verify_sha256 and int(os.environ.get("LOCAL_RANK", "0")) == 0
    train_corpus = open_corpus(config, "train", verify)
    valid_corpus = open_corpus(config, "valid", verify)
    transformer = model_config(config, train_corpus.vocab_size)
    dtype = PRECISION_DTYPES[t.precision]
    # Built in place (on `device`, in `dtype`): the tied-embedding sync inside runs on the
    # device (NCCL needs that at pp > 1), and no weight passes through a second copy.
    chunks = build_model_chunks(config.model.kind, transformer, t.seed, device=device, dtype=dtype)
    chunks, optimizer = prepare_training(config, chunks, dtype)
    train_data = _batches(config, train_corpus, dp)
    return Run(config, transformer, chunks, optimizer, train_data, valid_corpus, device, dtype, dp)


def _to_device(batch: dict, device: torch.device) -> dict:
    """A microbatch's arrays as tensors on `device`; BERT's loss_mask stays on the CPU, where
    the model finds the positions it selects without a host sync."""
    out = {}
    for name, array in batch.items():
        tensor = torch.as_tensor(array)
        out[name] = tensor if name == "loss_mask" else tensor.to(device, non_blocking=True)
    return out


def _forward_step(data_iterator, model):
    batch = next(data_iterator)
    if "labels" in batch:  # GPT
        output = model(batch["tokens"], batch["labels"])
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


def forward_backward(
    run: Run,
    microbatches: list,
    forward_only: bool = False,
    forward_step=None,
    names: tuple[str, ...] | None = None,
) -> dict:
    """Run one global batch through the pipeline; return its mean loss and the model's other
    statistics ({"loss": ..., BERT: "mlm_loss", "sop_loss", "sop_accuracy"}), as floats on
    every rank.  `forward_step` and the statistics' `names` default to the model kind's
    (a fine-tuning task brings its own)."""
    t = run.config.training
    interleaved = len(run.chunks) > 1
    infos = pipe.get_forward_backward_func()(
        forward_step_func=forward_step or _forward_step,
        data_iterator=[iter(microbatches) for _ in run.chunks]
        if interleaved
        else iter(microbatches),
        model=run.chunks if interleaved else run.chunks[0],
        num_microbatches=len(microbatches),
        seq_length=t.seq_length,
        micro_batch_size=t.micro_batch_size,
        hidden_size=run.model_config.hidden_size,
        dtype=run.dtype,
        sequence_parallel=run.model_config.sequence_parallel,
        forward_only=forward_only,
        grad_scale_func=None if forward_only else run.optimizer.scale_loss,
        finalize_model_grads_func=None if forward_only else pipe.finalize_model_grads,
    )
    # The last stage holds the losses: average over DP, then share over the pipeline.
    names = names or STATISTICS[run.kind]
    total = torch.zeros(len(names), device=run.device)
    if infos:
        total += torch.stack([torch.stack([i[n].float() for n in names]) for i in infos]).mean(0)
        dist.all_reduce(total, group=ps.get_data_parallel_group())
        total /= run.dp_size
    if ps.get_pipeline_model_parallel_world_size() > 1:
        dist.all_reduce(total, group=ps.get_pipeline_model_parallel_group())
    return dict(zip(names, total.tolist(), strict=True))


# What each model's last stage reports per microbatch ("loss" is what is trained).
STATISTICS = {"gpt": ("loss",), "bert": ("loss", "mlm_loss", "sop_loss", "sop_accuracy")}


def evaluate(run: Run, statistics: bool = False) -> float | dict:
    """Mean loss over `eval_iters` global batches of the valid split, always from its start
    (with `statistics`, every statistic of `forward_backward`, averaged)."""
    t = run.config.training
    batches = _batches(run.config, run.valid_corpus, run.dp_size)
    for c in run.chunks:
        c.eval()
    results = []
    with torch.no_grad():
        for _ in range(t.eval_iters):
            micro = [_to_device(next(batches), run.device) for _ in range(run.num_microbatches)]
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


def train_step(run: Run) -> dict:
    """One iteration; returns its loss, grad norm and learning rate."""
    lr = lr_for(run.config, run.iteration)
    for group in run.optimizer.param_groups:
        group["lr"] = lr
    micro = [_to_device(next(run.train_data), run.device) for _ in range(run.num_microbatches)]
    stats = forward_backward(run, micro)
    ok, grad_norm, _ = run.optimizer.step()
    run.optimizer.zero_grad()
    run.iteration += 1
    return {**stats, "lr": lr, "grad_norm": grad_norm, "ok": ok}


class StopSignal:
    """SIGTERM/SIGINT set a flag; the loop finishes its iteration, saves and returns.

    `agreed` shares the signal, so that afterwards every rank holds it: `signum` (the highest
    any rank got) and `received` (its name, or what else stopped the run, "exit_interval N").
    """

    def __init__(self):
        self.received = None
        self.signum = None
        self._previous = {}
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        self.signum = max(self.signum or 0, signum)
        self.received = signal.Signals(self.signum).name

    def agreed(self, device) -> bool:
        """Whether any rank got a signal (a collective, so every rank stops at the same step)."""
        flag = torch.tensor([float(self.signum or 0)], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        signum = int(flag.item())
        if signum and signum != self.signum:
            self.signum, self.received = signum, signal.Signals(signum).name
        return bool(signum)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def train(config: Config, stop: StopSignal | None = None) -> dict | None:
    """Train as configured; every rank of the job calls it.  Returns the history on rank 0.

    `stop` (made here if None) hears SIGINT/SIGTERM; its `signum` tells the caller afterwards
    whether a signal ended the run.  A collective that times out or loses a peer raises
    `CollectiveFailure`, naming this rank, the operation and the peers."""
    timeout = config.parallel.collective_timeout
    device, created = init_distributed(timeout)
    if device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))
    stop = stop or StopSignal()
    run = None
    try:
        run = build_run(config, device)
        resume(run)
        return _loop(run, stop)
    except RuntimeError as e:
        message = collective_failures.explain(e, timeout, run.iteration if run else None)
        if message is None:
            raise
        raise collective_failures.CollectiveFailure(message) from e
    finally:
        stop.restore()
        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
        if created:
            dist.destroy_process_group()


def resume(run: Run) -> None:
    """Load `checkpoint.load` if set (a `save` directory without a checkpoint yet starts fresh).

    Workers that torch's elastic agent restarted after a failure (--max-restarts) go on from
    the run's own last save instead, when there is one."""
    c = run.config.checkpoint
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0)
    load = c.load
    if restart and c.save and os.path.exists(os.path.join(c.save, checkpointing.LATEST)):
        load = c.save
    rank0 = dist.get_rank() == 0
    after = f"restart {restart} after a failed worker: " if restart else ""
    if not load or (
        load == c.save and not os.path.exists(os.path.join(load, checkpointing.LATEST))
    ):
        if rank0 and (load or restart):
            where = f" in {load}" if load else ""
            print(
                f"megatrain: {after}no checkpoint{where} yet; starting at iteration 0", flush=True
            )
        return
    meta = checkpointing.load_checkpoint(run, load)
    if rank0:
        print(f"megatrain: {after}resumed from {load} at iteration {meta['iteration']}", flush=True)


def _save(run: Run, log: RunLog) -> None:
    c = run.config.checkpoint
    if c.save:
        path = checkpointing.save_checkpoint(run, c.save, keep=c.keep)
        log.info(f"megatrain: saved {path}")


def _loop(run: Run, stop: StopSignal) -> dict | None:
    config, t, lg = run.config, run.config.training, run.config.logging
    c = config.checkpoint
    rank0 = dist.get_rank() == 0
    log = RunLog(t.output_dir, enabled=rank0, tensorboard=lg.tensorboard)
    if rank0:
        (Path(t.output_dir) / "config.json").write_text(json.dumps(config.to_dict(), indent=2))
    peak, peak_source = device_peak_tflops(run.device, lg.peak_tflops)
    # MFU counts what the model needs; HFU also what recomputation runs again, so a run with
    # full recompute is not credited for redoing its forward (HFU = MFU without recompute).
    flops, hardware_flops = flops_per_iteration(
        run.kind, run.model_config, t.global_batch_size, t.seq_length
    )
    world = dist.get_world_size()
    log.info(
        f"megatrain: {config.name}: {world} ranks = tp {config.parallel.tensor_model_parallel_size}"
        f" x pp {config.parallel.pipeline_model_parallel_size} x dp {run.dp_size}, "
        f"{run.num_microbatches} microbatches of {t.micro_batch_size} x {t.seq_length} tokens, "
        f"{t.precision}; peak {peak:.2f} TFLOP/s per device ({peak_source})"
    )
    guard = NonFiniteLossGuard(t.max_nonfinite_losses)
    interval, interval_start = [], time.perf_counter()
    loop_start, first_iteration = interval_start, run.iteration
    names = STATISTICS[run.kind]
    while run.iteration < t.train_iters:
        step = train_step(run)
        guard.check(step["loss"], run.iteration)
        for n in names:  # GPT: the loss; BERT: also its parts and the SOP accuracy
            run.history.setdefault(n, []).append(step[n])
        run.history["grad_norm"].append(step["grad_norm"])
        interval.append([step[n] for n in names])
        record = None
        if run.iteration % lg.log_interval == 0 or run.iteration == t.train_iters:
            elapsed = (time.perf_counter() - interval_start) / len(interval)
            tflops = flops / elapsed / world / 1e12  # model TFLOP/s per device
            record = {
                "iteration": run.iteration,
                "train_iters": t.train_iters,
                # The interval's means: the loss (BERT: and its parts, SOP accuracy).
                **{n: sum(v[i] for v in interval) / len(interval) for i, n in enumerate(names)},
                "lr": step["lr"],
                "grad_norm": step["grad_norm"],
                "loss_scale": run.optimizer.get_loss_scale(),
                "skipped": run.optimizer.num_skipped_steps,
                "ms_per_iter": elapsed * 1e3,
                "tokens_per_s": t.global_batch_size * t.seq_length / elapsed,
                "tflops": tflops,
                "mfu": tflops / peak,
                "hfu": hardware_flops / elapsed / world / 1e12 / peak,
            }
        if run.iteration % t.eval_interval == 0 or run.iteration == t.train_iters:
            record = record or {"iteration": run.iteration, "train_iters": t.train_iters}
            valid = evaluate(run, statistics=True)
            record.update({f"valid_{n}": v for n, v in valid.items()})
            # GPT: the perplexity of the loss; BERT: of the masked LM.
            record["valid_ppl"] = math.exp(min(valid.get("mlm_loss", valid["loss"]), 700))
            run.history["valid"].append((run.iteration, record["valid_loss"]))
        if record is not None:
            # Wall time of this run so far, and the rest at its pace (evaluations included).
            elapsed = time.perf_counter() - loop_start
            record["elapsed_s"] = elapsed
            pace = elapsed / (run.iteration - first_iteration)
            record["eta_s"] = pace * (t.train_iters - run.iteration)
            log.record(record)
        stopping = stop.agreed(run.device)
        if t.exit_interval and run.iteration % t.exit_interval == 0:
            stopping, stop.received = True, stop.received or f"exit_interval {t.exit_interval}"
        if (
            stopping
            or run.iteration == t.train_iters
            or (c.save_interval and run.iteration % c.save_interval == 0)
        ):
            _save(run, log)
        if record is not None:
            interval, interval_start = [], time.perf_counter()
        if stopping:
            log.info(
                f"megatrain: stopped by {stop.received or 'a signal'} at iteration {run.iteration}"
            )
            run.history["stopped_at"] = run.iteration
            break
    plot = log.close()
    if not rank0:
        return None
    log.info(f"megatrain: done; loss plot {plot}, log {Path(t.output_dir) / 'log.jsonl'}")
    return {**run.history, "plot": str(plot), "config": dataclasses.asdict(run.model_config)}
