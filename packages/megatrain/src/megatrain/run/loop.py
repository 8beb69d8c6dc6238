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
import json
import math
import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist

from megacore import parallel_state as ps
from megacore.optimizer import NonFiniteLossGuard
from megatrain.checkpoint.background import AsyncSaver
from megatrain.checkpoint.files import LATEST
from megatrain.checkpoint.load import load_checkpoint
from megatrain.checkpoint.save import save_checkpoint
from megatrain.config import Config
from megatrain.data.blend import BlendedBatches
from megatrain.plan.accounting import flops_per_iteration
from megatrain.run import failures
from megatrain.run.distributed import init_distributed
from megatrain.run.expert_load import ExpertLoad
from megatrain.run.metrics import RunLog, device_peak_tflops
from megatrain.run.setup import Run, build_run
from megatrain.run.step import evaluate, statistic_names, train_step


class StopSignal:
    """SIGTERM/SIGINT set a flag; the loop finishes its iteration, saves and returns.

    `agreed` shares the signal, so that afterwards every rank holds it: `signum` (the highest
    any rank got) and `received` (its name, or what else stopped the run, "exit_interval N").
    """

    def __init__(self):
        self.received = None
        self.signum = None
        self.at = None  # the iteration the run stopped at (any reason)
        self._previous = {}
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        self.signum = max(self.signum or 0, signum)
        self.received = signal.Signals(self.signum).name

    def agreed(self, device) -> bool:
        """Whether any rank got a signal (a collective, so every rank stops at the same step)."""
        return self.settle(self.flag(device).item())

    def flag(self, device) -> torch.Tensor:
        """The highest signal any rank got, all-reduced on `device` and not read yet (for a
        step that reads it with its own values: `settle` takes what was read)."""
        flag = torch.tensor([float(self.signum or 0)], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return flag

    def settle(self, value: float) -> bool:
        signum = int(value)
        if signum and signum != self.signum:
            self.signum, self.received = signum, signal.Signals(signum).name
        return bool(signum)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def _expert_layout(p, world: int) -> str:
    """The expert layout for the start line, when experts are split (etp x ep x edp)."""
    if p.expert_model_parallel_size == 1 and p.expert_tensor_parallel_size is None:
        return ""
    etp = p.expert_tensor_parallel_size or p.tensor_model_parallel_size
    ep = p.expert_model_parallel_size
    edp = world // (etp * ep * p.pipeline_model_parallel_size)
    return f" (experts: etp {etp} x ep {ep} x edp {edp})"


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
    run = saver = None
    try:
        run = build_run(config, device)
        resume(run)
        c = run.config.checkpoint
        if c.save and c.async_save:
            saver = AsyncSaver(c.save, c.keep, run.config.parallel.collective_timeout)
        return _loop(run, stop, saver)
    except RuntimeError as e:
        message = failures.explain(e, timeout, run.iteration if run else None)
        if message is None:
            raise
        raise failures.CollectiveFailure(message) from e
    finally:
        stop.restore()
        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
        # A background write still pending (abandoned at its deadline, or cut short by an
        # error) may have its writer in an agreement on the writers' group, which destroying
        # every group (each shut down) would pull from under it: the process's exit ends both.
        if created and not (saver is not None and saver.pending):
            dist.destroy_process_group()


def resume(run: Run) -> None:
    """Load `checkpoint.load` if set (a `save` directory without a checkpoint yet starts fresh),
    or start from the Hugging Face model `checkpoint.load_hf` at this layout.

    Workers that torch's elastic agent restarted after a failure (--max-restarts) go on from
    the run's own last save instead, when there is one; so does a run from `load_hf` whose
    `save` holds a checkpoint (the same command run again resumes)."""
    c = run.config.checkpoint
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0)
    load = c.load
    saved = bool(c.save) and os.path.exists(os.path.join(c.save, LATEST))
    if saved and (restart or c.load_hf):
        load = c.save
    rank0 = dist.get_rank() == 0
    after = f"restart {restart} after a failed worker: " if restart else ""
    if c.load_hf and load is None:
        from megatrain.hf.layout_load import load_hf

        load_hf(run, c.load_hf)
        return
    if not load or (load == c.save and not os.path.exists(os.path.join(load, LATEST))):
        if rank0 and (load or restart):
            where = f" in {load}" if load else ""
            print(
                f"megatrain: {after}no checkpoint{where} yet; starting at iteration 0", flush=True
            )
        return
    meta = load_checkpoint(run, load)
    if rank0:
        print(f"megatrain: {after}resumed from {load} at iteration {meta['iteration']}", flush=True)


def _save(run: Run, log: RunLog, saver: AsyncSaver | None, last: bool, bound: float | None):
    """Save at this iteration: at once, or (`saver`) copied now and written in the background
    (`AsyncSaver.checkpoint`: the `last` save of a run waits for its write, under a signal for
    at most `bound` seconds)."""
    c = run.config.checkpoint
    if not c.save:
        return
    if saver is None:
        path = save_checkpoint(run, c.save, keep=c.keep)
        log.info(f"megatrain: saved {path}")
        return
    saver.checkpoint(run, last, bound, log.info)


def _loop(run: Run, stop: StopSignal, saver: AsyncSaver | None) -> dict | None:
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
        f"{f' x cp {cp}' if (cp := config.parallel.context_parallel_size) > 1 else ''}"
        f" x pp {config.parallel.pipeline_model_parallel_size} x dp {run.dp_size}"
        f"{_expert_layout(config.parallel, world)}, "
        f"{run.num_microbatches} microbatches of {t.micro_batch_size} x {t.seq_length} tokens, "
        f"{t.precision}; peak {peak:.2f} TFLOP/s per device ({peak_source})"
    )
    if (counts := run.model_config.pipeline_layer_counts) is not None:
        log.info(
            "megatrain: transformer layers of each pipeline stage (virtual stages in model "
            f"order, parallel.pipeline_model_parallel_layout): {', '.join(map(str, counts))}"
        )
    if isinstance(run.train_data, BlendedBatches):  # what the run takes from each corpus
        log.info(f"megatrain: {run.train_data.describe(t.train_iters * t.global_batch_size)}")
    guard = NonFiniteLossGuard(t.max_nonfinite_losses)
    interval, interval_start = [], time.perf_counter()
    loop_start, first_iteration = interval_start, run.iteration
    names = statistic_names(run)
    cfg = run.model_config
    loads = None  # MoE: the experts' load over each log interval
    if cfg.num_moe_experts:
        loads = ExpertLoad(run.chunks, cfg.num_layers, cfg.num_moe_experts, run.device)
    while run.iteration < t.train_iters:
        # One read per iteration: the stop agreement goes with the step's own values (a signal
        # during this iteration's logging or evaluation then stops the next one).
        flag = {"stop_flag": stop.flag(run.device)} if t.one_sync_per_iteration else {}
        step = train_step(run, **flag)
        guard.check(step["loss"], run.iteration)
        for n in names:  # GPT: the loss; BERT: also its parts and the SOP accuracy
            run.history.setdefault(n, []).append(step[n])
        run.history["grad_norm"].append(step["grad_norm"])
        interval.append([step[n] for n in names])
        if loads is not None:
            loads.add()
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
                **run.train_data.log_fields(),
            }
            if "moe_aux_loss" in step:  # the step's load-balancing loss, without its coefficient
                record["moe_aux_loss"] = step["moe_aux_loss"]
            if loads is not None:  # every rank: the pipeline stages' layers summed
                record.update(loads.fields(cfg.moe_expert_capacity_factor is not None))
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
            if loads is not None and "moe_load" in record:
                collapse = loads.collapse_line(record, run.iteration)
                if collapse:
                    log.info(collapse)
        # What every rank agreed on: a signal that reached one rank after this iteration's
        # agreement is in the next one's, never in a choice of collectives here (below).
        signalled = stop.settle(step["stop"]) if "stop" in step else stop.agreed(run.device)
        stopping = signalled
        if t.exit_interval and run.iteration % t.exit_interval == 0:
            stopping, stop.received = True, stop.received or f"exit_interval {t.exit_interval}"
        if (
            stopping
            or run.iteration == t.train_iters
            or (c.save_interval and run.iteration % c.save_interval == 0)
        ):
            last = stopping or run.iteration == t.train_iters
            # The bound picks the background write's deadline all-reduce: from the agreed
            # signal, not `stop.signum`, which a signal sets on its own rank at any time.
            bound = c.async_save_timeout if signalled else None
            _save(run, log, saver, last, bound)
        if record is not None:
            interval, interval_start = [], time.perf_counter()
        if stopping:
            log.info(
                f"megatrain: stopped by {stop.received or 'a signal'} at iteration {run.iteration}"
            )
            run.history["stopped_at"] = stop.at = run.iteration
            break
    if saver is not None:
        saver.close()  # an abandoned write keeps its group
    plot = log.close()
    if not rank0:
        return None
    log.info(f"megatrain: done; loss plot {plot}, log {Path(t.output_dir) / 'log.jsonl'}")
    return {**run.history, "plot": str(plot), "config": dataclasses.asdict(run.model_config)}
