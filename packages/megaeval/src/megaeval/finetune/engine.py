"""Fine-tuning a BERT checkpoint on a task, on any tensor/pipeline layout with data
parallelism over the rest: `finetune(...)`, run by every rank (`megaeval finetune`).

The run is megatrain's: the same parallel groups, DDP / distributed optimizer and
`MegatronOptimizer` (`prepare_training`), the same pipeline schedules
(`forward_backward` with the task's forward step), the same checkpoints (saved
in `OUT/ckpt` every epoch and resumed from there).  The encoder starts from the
pretraining checkpoint's weights (its MLM and SOP heads are not read), the task head from
its own seed.  Examples are shuffled per epoch by (seed, epoch) and sliced as megatrain
slices samples (iteration t takes examples [tG, (t+1)G), data-parallel rank r its
contiguous share), so every layout trains on the same batches.  The learning rate warms up
linearly over `warmup` of the iterations, then decays linearly to zero.  After each epoch
(and with `eval_only`) the evaluation splits are scored as the official scripts score them.
"""

import contextlib
import hashlib
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from megacore import parallel_state as ps
from megacore import pipeline_parallel as pipe
from megaeval.finetune import tasks as tasks_lib
from megaeval.finetune.model import build_task_chunks
from megatrain.checkpoint.files import LATEST, find_checkpoint, read_meta
from megatrain.checkpoint.load import load_checkpoint, load_weights
from megatrain.checkpoint.save import save_checkpoint
from megatrain.config import Config, validate
from megatrain.data.samples import SampleBatches
from megatrain.inference.load import load_tokenizer
from megatrain.models import model_config
from megatrain.plan.accounting import parameter_count
from megatrain.run.distributed import init_distributed
from megatrain.run.lr_schedule import learning_rate
from megatrain.run.metrics import curves_from_log, plot_losses
from megatrain.run.setup import PRECISION_DTYPES, Run, prepare_training
from megatrain.run.step import forward_backward, to_device

STATISTICS = ("loss", "accuracy")


@dataclass
class Settings:
    """What `megaeval finetune` sets; None = Table 6's value for the model's size (batch,
    lr, epochs) or the task's (max_seq_length)."""

    tp: int = 1
    pp: int = 1
    batch_size: int | None = None  # examples per step
    lr: float | None = None
    epochs: int | None = None
    max_seq_length: int | None = None
    micro_batch_size: int = 4  # examples per microbatch
    warmup: float = 0.1  # fraction of the iterations
    weight_decay: float = 0.01
    clip_grad: float = 1.0
    dropout: float = 0.1
    seed: int = 1234
    precision: str | None = None  # fp32 on a CPU, bf16 on a GPU
    eval_only: bool = False
    log_interval: int = 10
    max_train_examples: int | None = None  # the first N (a quick look)
    exit_interval: int | None = None  # save and stop at a multiple of it (a job's time slice)
    max_eval_examples: int | None = None


class TaskData:
    """A split's features in the place of a corpus: what `SampleBatches` and checkpoints
    read of one (identity, size, the tokenizer's manifest entry)."""

    def __init__(self, task: str, split: str, feats, tokenizer_info: dict, vocab_size: int):
        self.path, self.split, self.feats = Path(task), split, feats
        self.num_docs = len(feats)
        self.num_tokens = int(feats.padding_mask.sum())
        self.vocab_size = vocab_size
        self.manifest = {"tokenizer": tokenizer_info}
        self._fingerprint = hashlib.sha256(
            json.dumps([task, split, [str(i) for i in feats.ids]]).encode()
        ).hexdigest()

    def fingerprint(self) -> str:
        return self._fingerprint


class TaskBatches(SampleBatches):
    """Microbatches of examples (each of `per_example` sequences) for one data-parallel rank;
    a microbatch's arrays are [examples x per_example, s], labels [examples(, 2)]."""

    def __init__(self, data: TaskData, seed: int, global_batch: int, micro: int, dp_rank, dp_size):
        self.samples_per_epoch = len(data.feats)
        self.per_example = data.feats.tokens.shape[1]
        seq = data.feats.tokens.shape[-1]
        super().__init__(data, seq, seed, global_batch, micro, dp_rank, dp_size)

    def identity(self) -> dict:
        return {"sampler": "finetune"}

    def epoch_order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, 7, epoch]).permutation(self.samples_per_epoch)

    def sample(self, k: int) -> int:
        epoch, j = divmod(k, self.samples_per_epoch)
        return int(self._order(epoch)[j])

    def collate(self, rows: list[int]) -> dict:
        f = self.corpus.feats
        s = f.tokens.shape[-1]
        return {
            "tokens": f.tokens[rows].reshape(-1, s),
            "token_types": f.token_types[rows].reshape(-1, s),
            "padding_mask": f.padding_mask[rows].reshape(-1, s),
            "labels": f.labels[rows],
        }


def _forward_step(data_iterator, model):
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["token_types"], batch["padding_mask"], batch["labels"])

    def loss_func(output):
        return output["loss"], {k: v.detach() for k, v in output.items()}

    return output, loss_func


def _is_main() -> bool:
    return dist.get_rank() == 0


def _say(message: str) -> None:
    if _is_main():
        print(message, flush=True)


def _config(meta: dict, task, settings: Settings, rows: tuple, train_size: int) -> Config:
    """The run config: the checkpoint's model at the asked layout, the task's batches."""
    batch, lr, epochs = rows
    config = Config.from_dict(meta["config"])
    p, t, o, m = config.parallel, config.training, config.optimizer, config.model
    p.tensor_model_parallel_size, p.pipeline_model_parallel_size = settings.tp, settings.pp
    p.virtual_pipeline_model_parallel_size = p.data_parallel_size = None
    p.sequence_parallel = p.distribute_saved_activations = False
    p.use_distributed_optimizer = p.overlap_param_gather = False
    p.data_parallel_sharding, p.reshard_after_forward = "none", None
    per_example = tasks_lib.CHOICES if task.head == "choice" else 1
    t.seq_length = settings.max_seq_length or task.max_seq_length
    # The pipeline's messages are counted in sequences: a RACE example is 4 of them.
    t.micro_batch_size = settings.micro_batch_size * per_example
    t.global_batch_size = batch * per_example
    steps_per_epoch = max(1, train_size // batch)
    t.train_iters = steps_per_epoch * epochs
    t.seed = settings.seed
    m.hidden_dropout = m.attention_dropout = settings.dropout
    m.recompute = "none"
    # Fine-tuning's batches are the task's, not the pretraining shapes the graphs were for.
    t.cuda_graphs = False
    o.lr, o.min_lr, o.lr_decay_style = lr, 0.0, "linear"
    o.lr_warmup_iters = int(settings.warmup * t.train_iters)
    o.lr_decay_iters = t.train_iters
    o.weight_decay, o.clip_grad = settings.weight_decay, settings.clip_grad
    t.precision = settings.precision or ("bf16" if torch.cuda.is_available() else "fp32")
    return config


def predict(run, feats, micro: int) -> np.ndarray | None:
    """The logits of every feature (rank 0 gets them; None elsewhere): forward only, each
    data-parallel rank a contiguous share, padded to whole microbatches."""
    dp, rank = run.dp_size, ps.get_data_parallel_rank()
    n = len(feats)
    share = math.ceil(n / dp)
    steps = max(1, math.ceil(share / micro))
    index = np.arange(rank * share, rank * share + steps * micro) % max(n, 1)
    s = feats.tokens.shape[-1]
    batches = [
        {
            "tokens": feats.tokens[rows].reshape(-1, s),
            "token_types": feats.token_types[rows].reshape(-1, s),
            "padding_mask": feats.padding_mask[rows].reshape(-1, s),
        }
        for rows in index.reshape(steps, micro)
    ]
    outputs = []

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        logits = model(batch["tokens"], batch["token_types"], batch["padding_mask"])

        def keep(output):
            outputs.append(output.float().cpu())
            return output.float().sum() * 0, {}

        return logits, keep

    interleaved = len(run.chunks) > 1
    for c in run.chunks:
        c.eval()
    with torch.no_grad():
        for batch in batches:
            micro_batch = [to_device(batch, run.device)]
            pipe.get_forward_backward_func()(
                forward_step_func=forward_step,
                data_iterator=[iter(micro_batch) for _ in run.chunks]
                if interleaved
                else iter(micro_batch),
                model=run.chunks if interleaved else run.chunks[0],
                num_microbatches=1,
                seq_length=run.config.training.seq_length,
                micro_batch_size=len(batch["tokens"]),
                hidden_size=run.model_config.hidden_size,
                dtype=run.dtype,
                sequence_parallel=False,
                forward_only=True,
            )
    for c in run.chunks:
        c.train()
    # The last stage's first TP rank of each data-parallel replica holds its share.
    mine = None
    if outputs and ps.get_tensor_model_parallel_rank() == 0:
        mine = (rank, torch.cat(outputs).numpy()[: max(0, min(share, n - rank * share))])
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    if not _is_main():
        return None
    shares = sorted(x for x in everyone if x is not None)
    return np.concatenate([logits for _, logits in shares])


def evaluate(run, task, evals: dict, settings: Settings, out: Path, epoch: int) -> dict:
    """Score every evaluation split; write OUT/metrics.json and OUT/predictions[-SPLIT].json."""
    results = {}
    for split, feats in evals.items():
        logits = predict(run, feats, settings.micro_batch_size)
        if logits is None:
            continue
        result, predictions = tasks_lib.score(task, split, feats, logits)
        results[split] = result
        name = "predictions.json" if len(evals) == 1 else f"predictions-{split}.json"
        (out / name).write_text(json.dumps(predictions, indent=1) + "\n")
    if _is_main():
        record = {"task": task.name, "epoch": epoch, "iteration": run.iteration, **results}
        (out / "metrics.json").write_text(json.dumps(record, indent=2) + "\n")
        for split, result in results.items():
            shown = ", ".join(f"{k} {v:.4f}" for k, v in result.items() if isinstance(v, float))
            print(f"megaeval finetune {task.name}: epoch {epoch} {split}: {shown}", flush=True)
    return results


# The run-config fields `megaeval finetune` sets, by the flag that sets them: a check of the
# config speaks of the flag.
FLAGS = {
    "parallel.tensor_model_parallel_size": "--tp",
    "parallel.pipeline_model_parallel_size": "--pp",
    "training.seq_length": "--max-seq-length",
    "model.": "the checkpoint's model.",
}


def _parameters(meta: dict) -> int:
    model = model_config(Config.from_dict(meta["config"]), int(meta["vocab_size"]))
    return parameter_count("bert", model)


def plan(task_name: str, meta: dict, settings: Settings, dp: int) -> tuple[str, tuple]:
    """The Table 6 row nearest the checkpoint's size and the (batch, lr, epochs) the run takes,
    after checking the settings against the checkpoint and the layout: `megaeval finetune`
    calls it before any worker starts, and a ValueError names the flag to change."""
    task = tasks_lib.TASKS[task_name]
    size, table = tasks_lib.table6_row(task.name, _parameters(meta))
    rows = (settings.batch_size or table[0], settings.lr or table[1], settings.epochs or table[2])
    batch, micro = rows[0], settings.micro_batch_size
    if batch % (micro * dp):
        given = "" if settings.batch_size else f" (Table 6's for {size})"
        raise ValueError(
            f"--batch-size {batch}{given} is not a multiple of --micro-batch-size {micro} x "
            f"--dp {dp}: pass a --batch-size or --micro-batch-size that makes it one"
        )
    seq = settings.max_seq_length or task.max_seq_length
    positions = Config.from_dict(meta["config"]).model.max_position_embeddings
    if seq > positions:
        given = "" if settings.max_seq_length else f" (the {task.name} default)"
        raise ValueError(
            f"--max-seq-length {seq}{given} is above the checkpoint's {positions} positions "
            f"(its model.max_position_embeddings): pass --max-seq-length {positions} or less"
        )
    try:
        validate(_config(meta, task, settings, rows, batch), settings.tp * settings.pp * dp)
    except ValueError as e:
        message = str(e)
        for field, flag in FLAGS.items():
            message = message.replace(field, flag)
        raise ValueError(message) from None
    return size, rows


def finetune(task_name: str, ckpt: str, data: str, out: str, settings: Settings) -> dict | None:
    """Fine-tune (or with `settings.eval_only` score) as the module docstring says; rank 0
    returns {"metrics": the last evaluation's, "losses": the training loss of each
    iteration this call ran}."""
    device, _ = init_distributed()
    task = tasks_lib.TASKS[task_name]
    out = Path(out)
    if _is_main():
        out.mkdir(parents=True, exist_ok=True)
    directory = find_checkpoint(ckpt)
    meta = read_meta(directory)
    tokenizer = load_tokenizer(directory, meta)  # the one it was trained with, checked
    vocab = int(meta["vocab_size"])
    dp = dist.get_world_size() // (settings.tp * settings.pp)
    size, rows = plan(task.name, meta, settings, dp)
    splits = ([] if settings.eval_only else [task.train_split]) + list(task.eval_splits)
    feats = {}
    for split in splits:
        examples, problems = tasks_lib.read_split(task, Path(data), split)
        limit = settings.max_train_examples if split == task.train_split else None
        limit = limit or (settings.max_eval_examples if split != task.train_split else None)
        examples = examples[:limit] if limit else examples
        if not examples:
            first = f"; first problem: {problems[0]}" if problems else ""
            raise ValueError(
                f"--data {data}: no usable {split} examples for {task.name} "
                f"({len(problems)} problem(s){first})"
            )
        if problems:
            _say(f"megaeval finetune: {split}: {len(problems)} problem(s), first: {problems[0]}")
        length = settings.max_seq_length or task.max_seq_length
        feats[split] = tasks_lib.features(
            task, examples, tokenizer, length, training=split == task.train_split
        )
        _say(f"megaeval finetune: {split}: {len(examples)} examples, {len(feats[split])} inputs")
    train_feats = feats.pop(task.train_split, None)
    _say(
        f"megaeval finetune {task.name}: Table 6 row {size} (nearest the checkpoint's "
        f"{_parameters(meta) / 1e6:.0f}M parameters); batch {rows[0]}, "
        f"lr {rows[1]:g}, {rows[2]} epochs"
    )
    train_size = len(train_feats) if train_feats is not None else rows[0]
    config = _config(meta, task, settings, rows, train_size)
    dp = validate(config, dist.get_world_size())
    ps.initialize_model_parallel(settings.tp, settings.pp)
    try:
        cfg = model_config(config, vocab)
        dtype = PRECISION_DTYPES[config.training.precision]
        chunks = build_task_chunks(
            cfg, task.head, task.num_classes, settings.seed, device=device, dtype=dtype
        )
        resuming = (out / "ckpt" / LATEST).is_file()
        # The encoder from the checkpoint; its task head too when it is a fine-tuned one.
        load_weights(chunks, directory, device, optional=("task_head.",))
        chunks, optimizer = prepare_training(config, chunks)
        data = TaskData(task.name, task.train_split, train_feats or next(iter(feats.values())),
                        meta.get("tokenizer") or {}, vocab)  # fmt: skip
        micro = config.training.micro_batch_size // (data.feats.tokens.shape[1])
        batches = TaskBatches(data, settings.seed, rows[0], micro, ps.get_data_parallel_rank(), dp)
        config.data.corpus = str(directory)  # where checkpoints copy the tokenizer from
        run = Run(config, cfg, chunks, optimizer, batches, None, device, dtype, dp)
        if resuming and not settings.eval_only:
            load_checkpoint(run, out / "ckpt")
            _say(f"megaeval finetune: resumed from {out / 'ckpt'} at iteration {run.iteration}")
        if settings.eval_only:
            metrics = evaluate(run, task, feats, settings, out, epoch=0)
            return {"metrics": metrics, "losses": []} if _is_main() else None
        return _train(run, task, feats, settings, out, rows)
    finally:
        ps.destroy_model_parallel()


def _train(run, task, evals: dict, settings: Settings, out: Path, rows: tuple) -> dict | None:
    losses: list[float] = []
    # Every iteration's loss, appended across resumed sessions (OUT/log.jsonl, OUT/loss.png).
    main = _is_main()
    with open(out / "log.jsonl", "a", buffering=1) if main else contextlib.nullcontext() as log:
        try:
            results, stopped = _iterations(run, task, evals, settings, out, rows, log, losses)
        finally:
            train, _ = curves_from_log(out / "log.jsonl") if main else ([], [])
            if train:
                plot_losses(train, [], out / "loss.png")
    if main and not stopped:
        (out / "settings.json").write_text(json.dumps(asdict(settings), indent=2) + "\n")
    return {"metrics": results, "losses": losses} if _is_main() else None


def _iterations(run, task, evals, settings, out, rows, log, losses) -> tuple[dict | None, bool]:
    """The iterations left: (the last evaluation's results, whether an exit interval stopped
    them before the end)."""
    t, o = run.config.training, run.config.optimizer
    steps_per_epoch = t.train_iters // rows[2]
    start, first = time.perf_counter(), run.iteration
    results = None
    while run.iteration < t.train_iters:
        lr = learning_rate(
            run.iteration,
            lr=o.lr,
            min_lr=o.min_lr,
            warmup_iters=o.lr_warmup_iters,
            decay_iters=o.lr_decay_iters,
            style="linear",
        )
        for group in run.optimizer.param_groups:
            group["lr"] = lr
        micro = [to_device(next(run.train_data), run.device) for _ in range(run.num_microbatches)]
        stats = forward_backward(run, micro, forward_step=_forward_step, names=STATISTICS)
        run.optimizer.step()
        run.optimizer.zero_grad()
        run.iteration += 1
        losses.append(stats["loss"])
        if log is not None:
            record = {"iteration": run.iteration, "loss": stats["loss"], "lr": lr}
            log.write(json.dumps({**record, "accuracy": stats["accuracy"]}) + "\n")
        done = run.iteration - first
        if run.iteration % settings.log_interval == 0 or run.iteration == t.train_iters:
            elapsed = time.perf_counter() - start
            eta = elapsed / done * (t.train_iters - run.iteration)
            _say(
                f"iteration {run.iteration}/{t.train_iters} | loss {stats['loss']:.4f} | "
                f"accuracy {stats['accuracy']:.3f} | lr {lr:.3e} | elapsed {elapsed:.0f} s | "
                f"ETA {eta:.0f} s"
            )
        epoch_end = run.iteration % steps_per_epoch == 0 or run.iteration == t.train_iters
        stopping = bool(settings.exit_interval) and run.iteration % settings.exit_interval == 0
        if epoch_end or stopping:
            save_checkpoint(run, out / "ckpt", keep=1)
        if epoch_end:
            epoch = math.ceil(run.iteration / steps_per_epoch)
            results = evaluate(run, task, evals, settings, out, epoch)
        if stopping and run.iteration < t.train_iters:
            _say(f"megaeval finetune: stopped at iteration {run.iteration} (exit_interval)")
            return results, True
    if results is None:  # resumed after the last iteration: score what was saved
        results = evaluate(run, task, evals, settings, out, rows[2])
    return results, False
