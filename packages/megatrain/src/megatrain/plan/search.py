"""Every layout of a config on a number of GPUs, ranked by predicted step time.

A layout is tp x cp x pp x dp = the GPUs, a virtual pipeline size (interleaving; where pp x
vpp does not divide the layers, Megatron-Bridge's uneven split, `_pipelines`), a micro
batch size, a recompute mode, sequence parallelism (tp > 1; for a mixture of experts always,
as a run requires), the data-parallel sharding
(dp x cp > 1: none, the distributed optimizer, or FSDP, which with gradient accumulation
either holds the unsharded gradients to the step's end or reduce-scatters every
microbatch's), and for context parallelism (cp: 1, 2, 4, ... dividing the GPUs; the
sequence must cut into 2 x cp chunks) its attention's communication, "p2p" or
"allgather", or for multi-latent attention also "latent" (`cp_comm_types`); for a mixture
of experts (`model.num_moe_experts`) the expert-parallel size ep (dividing the experts) and
the experts' tensor-parallel size etp (1, or tp), where etp x ep divides the GPUs of a
pipeline stage.  Each candidate goes through megatrain.config.validate,
the check `megatrain run` makes before starting workers, so the plan refuses exactly what a
run would; the ones that pass are estimated (cost_model.py) and kept if the fullest stage
leaves memory.HEADROOM of the GPU free.  What is refused is summed up by reason, with an
example of each.
"""

import contextlib
import multiprocessing
import os
import re
import sys
from dataclasses import dataclass, field, replace

from megacommon.progress import progress_bar
from megatrain.config import DATA_PARALLEL_SHARDINGS as SHARDINGS
from megatrain.config import RECOMPUTE_CHOICES, Config, ConfigError, validate
from megatrain.plan.cost_model import Estimate, estimate, memory_per_gpu
from megatrain.plan.costs import Costs
from megatrain.plan.hardware import GIB, Gpu, Profile
from megatrain.plan.layout import Layout, apply_layout, balanced_pipeline_layout
from megatrain.plan.memory import HEADROOM

MAX_VPP = 8  # virtual stages per GPU tried (Megatron's own examples stop at a few)
UNEVEN_VPP = (1, 2, 4)  # ... where the layers split unevenly (`_pipelines`)
MAX_MICRO_BATCH = 64
OUT_OF_MEMORY = "does not fit in memory"
SPLITS_PER_TASK = 4  # splits a search worker takes at a time (`plan`)
MIN_SPLITS_TO_FORK = 64  # fewer take less time than forking the workers


@dataclass
class Plan:
    config: Config
    gpu: Gpu
    profile: Profile
    gpus: int
    global_batch: int
    vocab_size: int
    ranked: list[Estimate]  # the layouts that fit, fastest first
    rejected: dict = field(default_factory=dict)  # reason -> {"count", "example"}
    enumerated: int = 0
    fixed: dict = field(default_factory=dict)  # only the splits with these values searched

    def position(self, layout: Layout) -> int | None:
        """0-based rank of `layout` among those that fit; None if it does not.  A layout
        leaving FSDP's reduce_every_microbatch to the config (None) is the config's choice."""
        wanted = self._settled(layout)
        for i, e in enumerate(self.ranked):
            if self._settled(e.layout) == wanted:
                return i
        return None

    def _settled(self, layout: Layout) -> Layout:
        if not layout.fsdp:
            return replace(layout, reduce_every_microbatch=None)
        every = layout.reduce_every_microbatch
        every = self.config.parallel.reduce_every_microbatch if every is None else every
        return replace(layout, reduce_every_microbatch=bool(every))


def _divisors(n: int, up_to: int | None = None) -> list[int]:
    return [d for d in range(1, (up_to or n) + 1) if n % d == 0]


def _context_parallel_sizes(n: int) -> list[int]:
    """1, 2, 4, ... dividing n: megatron-core's CP sizes (a ring of 2·cp balanced chunks)."""
    return [1 << i for i in range(n.bit_length()) if n % (1 << i) == 0]


def _reason(error: ConfigError) -> str:
    """A validation message with its numbers taken out, so equal reasons add up (whole
    numbers only: a schedule's name such as '1f1b' or 'zb-h1' stays as it is)."""
    return re.sub(r"\b\d+\b", "N", str(error))


def candidates(config: Config, gpus: int, global_batch: int):
    """(layout, None) for each layout to estimate, or (layout, ConfigError) for the
    refused; a (tp, cp, pp) the model cannot be split into is refused once, for micro
    batch 1."""
    for split in _splits(config, gpus):
        for layout, error, _ in _layouts_of(config, gpus, global_batch, *split):
            yield layout, error


SPLIT_FIELDS = ("tp", "cp", "pp", "cp_comm", "ep", "etp")


def _splits(config: Config, gpus: int, fixed: dict | None = None) -> list[tuple]:
    """Each (tp, cp, pp, CP communication, ep, etp) of `gpus` the search tries; `fixed`: only
    those with these values (`SPLIT_FIELDS` names)."""
    fixed = fixed or {}
    unknown = set(fixed) - set(SPLIT_FIELDS)
    if unknown:
        raise ValueError(f"fixed: {sorted(unknown)} are not among {SPLIT_FIELDS}")
    splits = [
        (tp, cp, pp, comm, ep, etp)
        for tp in _divisors(gpus)
        for cp in _context_parallel_sizes(gpus // tp)
        for pp in _divisors(gpus // (tp * cp))
        for comm in (cp_comm_types(config) if cp > 1 else ("p2p",))
        for ep, etp in _expert_layouts(config, gpus // pp, tp)
    ]
    return [
        split
        for split in splits
        if all(split[SPLIT_FIELDS.index(name)] == value for name, value in fixed.items())
    ]


def parse_fixed(items: list[str]) -> dict:
    """`megatrain plan --fix NAME=VALUE` (repeated) as `plan`'s `fixed`: NAME one of
    `SPLIT_FIELDS`, VALUE a whole number (cp_comm: p2p, allgather or latent; etp: also none,
    the tensor-parallel size).  A malformed item is refused naming it and what is expected."""
    fixed: dict = {}
    for item in items:
        name, _, value = item.partition("=")
        name, value = name.strip(), value.strip()
        if name not in SPLIT_FIELDS or not value:
            raise ValueError(
                f"--fix {item!r}: expected NAME=VALUE with NAME one of {', '.join(SPLIT_FIELDS)}"
            )
        if name == "cp_comm":
            if value not in ("p2p", "allgather", "latent"):
                raise ValueError(f"--fix {item!r}: cp_comm is p2p, allgather or latent")
            fixed[name] = value
        elif name == "etp" and value.lower() == "none":
            fixed[name] = None
        elif value.isdigit() and int(value) > 0:
            fixed[name] = int(value)
        else:
            raise ValueError(f"--fix {item!r}: {name} takes a whole number above 0")
    return fixed


def cp_comm_types(config: Config) -> tuple[str, ...]:
    """The context-parallel communications the search weighs: megacore's ring ("p2p") and
    all-gather of K/V, and for multi-latent attention the gather of its compressed latent
    ("latent"), which trades the K/V traffic for up-projecting every rank's whole sequence."""
    latent = ("latent",) if config.model.multi_latent_attention else ()
    return ("p2p", "allgather", *latent)


def _expert_layouts(config: Config, stage_gpus: int, tp: int) -> list[tuple[int, int | None]]:
    """(ep, etp) pairs to try: ep dividing the experts, etp the tensor-parallel size (None)
    or 1, etp x ep dividing a stage's GPUs (megatron-core's parallel folding); (1, None) for a
    dense model."""
    experts = config.model.num_moe_experts
    if not experts:
        return [(1, None)]
    return [
        (ep, etp)
        for etp in ([None, 1] if tp > 1 else [None])
        for ep in _divisors(experts)
        if stage_gpus % (ep * (tp if etp is None else etp)) == 0
    ]


def _layouts_of(
    config: Config, gpus: int, global_batch: int, tp: int, cp: int, pp: int, comm, ep=1, etp=None
):
    """`candidates` at one tp, cp, pp, CP communication and expert layout."""
    dp = gpus // (tp * cp * pp)
    pipelines = _pipelines(config, pp)
    base = Layout(
        tp=tp, pp=pp, dp=dp, cp=cp, cp_comm=comm, ep=ep, etp=etp,
        vpp=pipelines[0][0], schedule=pipelines[0][1], pipeline_layout=pipelines[0][2],
    )  # fmt: skip
    try:
        validate(apply_layout(config, base, global_batch), gpus)
    except ConfigError as e:
        # A mixture of experts at tp > 1 needs sequence parallelism: the split is refused
        # only if it is refused with it too.
        with_sp = replace(base, sequence_parallel=True)
        if tp == 1 or not _accepted(apply_layout(config, with_sp, global_batch), gpus):
            yield base, e, None
            return
    per_replica = global_batch // dp
    # Sequence parallelism at tp > 1; only with it for a mixture of experts, which a run
    # refuses without it (the base layout above says so once when the split is refused)
    sequence_parallel_choices = (False, True) if tp > 1 else (False,)
    if tp > 1 and config.model.num_moe_experts:
        sequence_parallel_choices = (True,)
    for mb in _divisors(per_replica, min(per_replica, MAX_MICRO_BATCH)):
        for vpp, schedule, pipeline_layout in pipelines:
            for recompute in RECOMPUTE_CHOICES:
                for sp in sequence_parallel_choices:
                    for sharding, every in _shardings(dp * cp, per_replica // mb):
                        layout = Layout(
                            tp, pp, dp, vpp, mb, recompute, sp, sharding == "optimizer",
                            schedule, cp, comm, fsdp=sharding == "full", ep=ep, etp=etp,
                            reduce_every_microbatch=every, pipeline_layout=pipeline_layout,
                        )  # fmt: skip
                        config_at = apply_layout(config, layout, global_batch)
                        try:
                            validate(config_at, gpus)
                        except ConfigError as e:
                            yield layout, e, None
                            continue
                        yield layout, None, config_at


def _accepted(config: Config, gpus: int) -> bool:
    try:
        validate(config, gpus)
    except ConfigError:
        return False
    return True


def _shardings(replicas: int, microbatches: int) -> list[tuple[str, bool | None]]:
    """(data-parallel sharding, FSDP reducing every microbatch) pairs: with gradient
    accumulation FSDP either holds every unsharded fp32 gradient until the last microbatch or
    reduce-scatters each microbatch's (memory for communication), so both are tried; None
    where it does not apply."""
    if replicas == 1:
        return [(SHARDINGS[0], None)]
    pairs: list[tuple[str, bool | None]] = [(s, None) for s in SHARDINGS if s != "full"]
    return pairs + [("full", every) for every in ((False, True) if microbatches > 1 else (None,))]


def _pipelines(config: Config, pp: int) -> list[tuple[int, str, str | None]]:
    """(vpp, schedule, pipeline layout) triples at pp: 1F1B and ZB-H1 without virtual stages,
    interleaved with them; the layers split evenly where pp x vpp divides them, else by
    `balanced_pipeline_layout` (Megatron-Bridge's split), tried at vpp 1, 2 and 4
    (`UNEVEN_VPP`: every vpp would multiply a search that is already the longest for the
    models that need it, such as DeepSeek-V3's 61 layers)."""
    if pp == 1:
        return [(1, "1f1b", None)]
    m = config.model
    layers, mtp = m.num_layers, m.mtp_num_layers or 0
    splits = [(v, None) for v in range(1, MAX_VPP + 1) if layers % (pp * v) == 0] + [
        (v, layout)
        for v in UNEVEN_VPP
        if (layout := balanced_pipeline_layout(layers, pp, v, mtp)) is not None
    ]
    triples = []
    for vpp, layout in splits:
        schedules = ("1f1b", "zb-h1") if vpp == 1 else ("interleaved",)
        triples += [(vpp, schedule, layout) for schedule in schedules]
    if not splits:  # the even split, to be refused by name
        triples = [(1, "1f1b", None)]
    return triples


@dataclass
class _Job:
    """What every split's search shares (`_search_splits`)."""

    config: Config
    gpus: int
    gpu: Gpu
    profile: Profile
    vocab_size: int
    global_batch: int

    def estimate(self, layout: Layout, memory: dict) -> Estimate:
        return estimate(
            self.config, layout, self.gpu, self.profile, self.vocab_size, self.global_batch,
            memory,
        )  # fmt: skip


@dataclass
class _Found:
    """Some splits' part of a search: `Plan`'s counts, and the nearest layout out of memory."""

    ranked: list = field(default_factory=list)
    rejected: dict = field(default_factory=dict)
    enumerated: int = 0
    nearest: tuple | None = None  # (layout, memory)

    def add(self, other: "_Found") -> None:
        """`other`'s found after this one's, as one pass over both in turn would count them."""
        self.ranked += other.ranked
        self.enumerated += other.enumerated
        for reason, entry in other.rejected.items():
            mine = self.rejected.setdefault(reason, {"count": 0, "example": ""})
            mine["count"] += entry["count"]
            mine["example"] = mine["example"] or entry["example"]
        if other.nearest and (
            not self.nearest or other.nearest[1]["total"] < self.nearest[1]["total"]
        ):
            self.nearest = other.nearest


def _search_splits(job: _Job, splits: list[tuple]) -> _Found:
    """Every candidate of `splits` validated, and estimated where it fits."""
    found = _Found()
    usable = (1 - HEADROOM) * job.gpu.memory_bytes
    # Layouts (micro batch and recompute aside) whose weights, gradients and optimizer state
    # alone exceed the GPU: every micro batch and recompute of them is out of memory too (not
    # under FSDP, whose gathered parameters depend on the microbatches), so their memory is
    # not estimated again: the cost of the search for a model as large as DeepSeek-V3.  A
    # key holds its split's sizes, so splits searched apart find the same.
    state_too_big: set = set()
    for split in splits:
        for layout, error, config_at in _layouts_of(job.config, job.gpus, job.global_batch, *split):
            found.enumerated += 1
            state_key = None if layout.fsdp else replace(layout, micro_batch=0, recompute="")
            if error is None and state_key in state_too_big:
                reason = OUT_OF_MEMORY  # the nearest has been seen: its state alone is larger
            elif error is None:
                # Memory first: the step time only of the layouts that fit (at long sequences
                # most do not).
                memory = memory_per_gpu(config_at, job.vocab_size, layout.dp, job.gpu.attention)
                if state_key is not None and memory["total"] - memory["activations"] > usable:
                    state_too_big.add(state_key)
                if memory["total"] <= usable:
                    found.ranked.append(job.estimate(layout, memory))
                    continue
                reason = OUT_OF_MEMORY
                if not found.nearest or memory["total"] < found.nearest[1]["total"]:
                    found.nearest = (layout, memory)
            else:
                reason = _reason(error)
            entry = found.rejected.setdefault(reason, {"count": 0, "example": ""})
            entry["count"] += 1
            if error is not None and not entry["example"]:
                entry["example"] = f"{layout.describe()}: {error}"
    return found


_WORKER_JOB: _Job | None = None  # a search worker's job, set before it forks (`_pool`)


def _search_in_worker(splits: list[tuple]) -> _Found:
    return _search_splits(_WORKER_JOB, splits)


def search_workers() -> int:
    """The CPUs this process may run on (its affinity: a Slurm step's, a container's)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _pool(job: _Job, workers: int):
    """A pool of `workers` processes forked with `job`, or None where forking is not the
    platform's safe default (macOS and Windows spawn, which would import torch again in
    each): the search then runs in this process."""
    global _WORKER_JOB
    if workers <= 1 or sys.platform != "linux":
        return None
    _WORKER_JOB = job
    try:
        return multiprocessing.get_context("fork").Pool(workers)
    finally:
        _WORKER_JOB = None


def plan(
    config: Config,
    gpus: int,
    gpu: Gpu,
    profile: Profile,
    vocab_size: int,
    global_batch: int | None = None,
    progress: bool = False,
    fixed: dict | None = None,
    workers: int = 1,
) -> Plan:
    """Every layout of `config` on `gpus` GPUs of kind `gpu`, the fitting ones ranked;
    `progress`: show how far the search is on stderr (hundreds of GPUs take seconds, a
    DeepSeek-V3 on 256 minutes); `fixed`: search only the splits with these values
    of `SPLIT_FIELDS` (tp, cp, pp, cp_comm, ep, etp; etp None is tp), e.g. {"cp": 1};
    `workers`: processes searching the splits side by side (`search_workers()`: every CPU
    this process may use), the result the same as one's, in the same order."""
    global_batch = global_batch or config.training.global_batch_size
    # a precision the GPU or the profile cannot time (fp8 without its peak or its GEMMs'
    # efficiency): refused here, before the search
    Costs(gpu, profile, config.training.precision)
    result = Plan(
        config, gpu, profile, gpus, global_batch, vocab_size, ranked=[], fixed=dict(fixed or {})
    )
    job = _Job(config, gpus, gpu, profile, vocab_size, global_batch)
    splits = _splits(config, gpus, fixed)
    # Splits in order, a few to a task (their costs differ by orders of magnitude), merged in
    # that order: the refusals' examples and the ranking's ties come out as from one process.
    tasks = [splits[i : i + SPLITS_PER_TASK] for i in range(0, len(splits), SPLITS_PER_TASK)]
    pool = _pool(job, min(workers, len(tasks))) if len(splits) >= MIN_SPLITS_TO_FORK else None
    found = _Found()
    with (
        pool or contextlib.nullcontext(),
        progress_bar(len(splits), "megatrain plan", "splits", enabled=progress, leave=False) as bar,
    ):
        parts = pool.imap(_search_in_worker, tasks) if pool else (
            _search_splits(job, task) for task in tasks
        )  # fmt: skip
        for task, part in zip(tasks, parts, strict=True):
            found.add(part)
            bar.update(len(task))
    result.ranked, result.rejected, result.enumerated = (
        found.ranked,
        found.rejected,
        found.enumerated,
    )
    if found.nearest:
        layout, memory = found.nearest
        usable = (1 - HEADROOM) * gpu.memory_bytes
        result.rejected[OUT_OF_MEMORY]["example"] = (
            f"the nearest, {layout.describe()}, needs {memory['total'] / GIB:.1f} GiB on "
            f"stage {memory['stage']}; {usable / GIB:.1f} GiB usable "
            f"({1 - HEADROOM:.0%} of {gpu.memory_gib:g})"
        )
    # the faster first; of equal times (FSDP's reductions hidden either way) the smaller
    result.ranked.sort(key=lambda e: (e.time["total"], e.memory["total"]))
    return result


def compiled_float8(plan: Plan) -> Estimate | None:
    """#1 of an fp8 plan without training.compile, timed with it (the float8 casts fused:
    `costs.FLOAT8_CAST_BYTES`), when the layout allows compile; None otherwise."""
    t = plan.config.training
    if t.precision != "fp8" or t.compile or not plan.ranked:
        return None
    best = plan.ranked[0]
    config = replace(plan.config, training=replace(t, compile=True))
    try:
        validate(apply_layout(config, best.layout, plan.global_batch), world_size=plan.gpus)
    except ConfigError:  # compile refused at that layout (MoE layers, CUDA graphs, ...)
        return None
    return estimate(
        config, best.layout, plan.gpu, plan.profile, plan.vocab_size, plan.global_batch,
        memory=best.memory,
    )  # fmt: skip


def memory_warning(
    config: Config, dp: int, vocab_size: int, gpu_memory_bytes: float, attention: str = "unfused"
) -> str | None:
    """Why `config`'s layout will not fit a GPU of `gpu_memory_bytes` whose attention kernel
    is `attention` (gpus.toml's field: "flash" on Ampere and newer), or None if it does."""
    memory = memory_per_gpu(config, vocab_size, dp, attention)
    usable = (1 - HEADROOM) * gpu_memory_bytes
    if memory["total"] <= usable:
        return None
    parts = ", ".join(
        f"{name.replace('_', ' ')} {memory[name] / GIB:.1f}"
        for name in ("weights", "gradients", "optimizer_state", "activations")
    )
    return (
        f"the planner predicts {memory['total'] / GIB:.1f} GiB per GPU on pipeline stage "
        f"{memory['stage']} ({parts} GiB), above {1 - HEADROOM:.0%} of this GPU's "
        f"{gpu_memory_bytes / GIB:.1f} GiB"
    )
