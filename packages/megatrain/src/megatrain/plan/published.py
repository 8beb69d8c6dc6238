"""Published training runs (published_runs.toml) and the planner's prediction of each.

`load_runs` reads the table into `PublishedRun`s, refusing a malformed row with an error
that names the row and the field; `predict` estimates a run at its own layout with
cost_model.estimate and returns the number the source published (tokens/s per GPU, or
hardware or model TFLOP/s per GPU).  `benchmarks/bench_plan.py --published` prints the two
side by side.  Rows marked use = "check" were never used to fit the profile.
"""

import statistics
import sys
from dataclasses import dataclass, field, replace
from importlib import resources
from pathlib import Path

from megatrain.config import (
    Config,
    ConfigError,
    ModelConfig,
    ParallelConfig,
    TrainingConfig,
    validate,
)
from megatrain.config.load import apply_sections
from megatrain.plan.accounting import ATTENTION_IMPLEMENTATIONS, RECOMPUTE_IMPLEMENTATIONS
from megatrain.plan.cost_model import Estimate, estimate
from megatrain.plan.costs import Costs
from megatrain.plan.hardware import GIB, PRECISIONS, Gpu, Profile, builtin_profile, load_gpus
from megatrain.plan.layout import Layout
from megatrain.plan.memory import HEADROOM

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

USES = ("fit", "check")
METRICS = ("tokens_per_s_per_gpu", "hardware_tflops_per_gpu", "model_tflops_per_gpu")
KINDS = ("gpt", "llama", "bert")
RECOMPUTE = ("none", "selective", "full", *RECOMPUTE_IMPLEMENTATIONS)
SHARDING = ("none", "optimizer", "full")
# (field, type, required) per section; ints are sizes (> 0).
_TOP = {"name": str, "use": str, "source": str, "where": str}
_MODEL = {"kind": str, "layers": int, "hidden": int, "heads": int, "ffn": int, "vocab": int}
# dropout: the hidden and attention dropout probability (absent: 0, none); fields: megatrain
# [model] fields beyond the shape, by their names (a mixture of experts, windows, sinks, biases:
# gpt-oss), checked as a config file's
_MODEL_OPTIONAL = {"query_groups": int, "dropout": float, "fields": dict}
# the [model] fields the row's own shape sets (model.fields may not set them again)
_SHAPE_FIELDS = (
    "kind", "num_layers", "hidden_size", "num_attention_heads", "num_query_groups",
    "ffn_hidden_size", "max_position_embeddings", "vocab_size", "hidden_dropout",
    "attention_dropout", "recompute",
)  # fmt: skip
_LAYOUT = {
    "gpu": str, "gpus": int, "tp": int, "pp": int, "dp": int, "micro_batch": int,
    "global_batch": int, "seq_length": int, "precision": str, "recompute": str, "sharding": str,
}  # fmt: skip
# The data-parallel overlaps (absent: the config's defaults, overlap_grad_reduce on and
# overlap_param_gather off), FSDP reducing every microbatch (absent: once a step), whether the
# run overlapped TP communication with its GEMMs (recorded; megatrain does not, and the plan
# charges TP collectives on the critical path), and the memory of the run's GPUs in GiB where
# it is not the GPU entry's (absent: the entry's; only the fits check reads it); whether the
# output layer and its loss ran fused (training.fused_linear_cross_entropy; absent: not);
# whether its layers ran compiled (training.compile, which fuses fp8's casts; absent: not);
# the attention implementation the run ran (accounting.ATTENTION_IMPLEMENTATIONS; absent: its
# GPU entry's).
_LAYOUT_OPTIONAL = {
    "vpp": int, "cp": int, "ep": int, "etp": int, "sequence_parallel": bool,
    "overlap_grad_reduce": bool,
    "overlap_param_gather": bool, "reduce_every_microbatch": bool, "tp_comm_overlap": bool,
    "gpu_memory_gib": float, "fused_linear_cross_entropy": bool, "attention": str,
    "compile": bool, "pipeline_layout": str, "plan_memory_over": str,
}  # fmt: skip
# the [run.layout] fields that are megatrain config fields, by section
_PARALLEL_FIELDS = (
    "overlap_grad_reduce", "overlap_param_gather", "reduce_every_microbatch", "tp_comm_overlap",
)  # fmt: skip
_TRAINING_FIELDS = ("fused_linear_cross_entropy", "compile")
_MAY_BE_ZERO = {"dropout"}  # numbers that may be 0 (the rest must be positive)
_PUBLISHED = {"metric": str, "value": float, "definition": str}
_PUBLISHED_OPTIONAL = {"assumed": list}
_TYPE_NAMES = {str: "a string", int: "a whole number", float: "a number", bool: "true or false",
               list: "a list", dict: "a table"}  # fmt: skip


class PublishedError(ValueError):
    """A published_runs.toml row that cannot be used; the message names the row and field."""


@dataclass(frozen=True)
class PublishedRun:
    name: str
    use: str  # "fit" or "check"
    source: str
    where: str
    # kind, layers, hidden, heads, ffn, vocab; query_groups, dropout, fields (optional)
    model: dict
    gpu: str  # a key of the GPU table
    gpus: int
    layout: Layout
    global_batch: int
    seq_length: int
    precision: str
    metric: str
    value: float
    definition: str
    assumed: tuple = field(default_factory=tuple)
    # the [run.layout] fields of the parallel and training sections that Layout does not carry
    parallel: dict = field(default_factory=dict)
    training: dict = field(default_factory=dict)
    gpu_memory_gib: float | None = None
    attention: str | None = None  # the implementation the run ran; None: its GPU entry's
    # why megatrain's memory at the run's layout is over its GPUs though the run fit (what
    # the run's framework keeps less of); None: the plan's memory fits, as it must
    plan_memory_over: str | None = None

    def config(self) -> Config:
        """The run as a megatrain config (its layout applied by `estimate`)."""
        m = self.model
        config = Config(
            model=ModelConfig(
                kind=m["kind"],
                num_layers=m["layers"],
                hidden_size=m["hidden"],
                num_attention_heads=m["heads"],
                num_query_groups=m.get("query_groups"),
                ffn_hidden_size=m["ffn"],
                max_position_embeddings=self.seq_length,
                vocab_size=m["vocab"],
                hidden_dropout=m.get("dropout", 0.0),
                attention_dropout=m.get("dropout", 0.0),
                recompute=RECOMPUTE_IMPLEMENTATIONS.get(
                    self.layout.recompute, self.layout.recompute
                ),
            ),
            parallel=ParallelConfig(**self.parallel),
            training=TrainingConfig(
                seq_length=self.seq_length,
                micro_batch_size=self.layout.micro_batch,
                global_batch_size=self.global_batch,
                precision=self.precision,
                **self.training,
            ),
        )
        apply_sections(config, {"model": m.get("fields", {})}, f"run {self.name!r}")
        return config


def _fields(row: dict, section: str, where: str, required: dict, optional: dict) -> dict:
    """`row`'s fields of `required` (all present) and `optional`, type-checked."""
    known = {**required, **optional}
    unknown = [k for k in row if k not in known]
    if unknown:
        raise PublishedError(
            f"{where}: unknown field {section}{unknown[0]}; known: {', '.join(known)}"
        )
    out = {}
    for name, kind in known.items():
        if name not in row:
            if name in required:
                raise PublishedError(f"{where}: {section}{name} is missing")
            continue
        value = row[name]
        ok = (
            isinstance(value, int | float) and not isinstance(value, bool)
            if kind is float
            else isinstance(value, kind) and not (kind is int and isinstance(value, bool))
        )
        if not ok:
            raise PublishedError(f"{where}: {section}{name} = {value!r} is not {_TYPE_NAMES[kind]}")
        if kind in (int, float) and name in _MAY_BE_ZERO and not 0 <= value < 1:
            raise PublishedError(f"{where}: {section}{name} = {value!r} must be in [0, 1)")
        if kind in (int, float) and name not in _MAY_BE_ZERO and value <= 0:
            raise PublishedError(f"{where}: {section}{name} = {value!r} must be positive")
        out[name] = float(value) if kind is float else value
    return out


def _choice(value: str, choices: tuple, where: str, name: str) -> None:
    if value not in choices:
        raise PublishedError(f"{where}: {name} = {value!r}; expected one of {', '.join(choices)}")


def _run(row: dict, index: int, source: str, gpus: dict[str, Gpu]) -> PublishedRun:
    where = f"{source}: run {index + 1}"
    if not isinstance(row, dict):
        raise PublishedError(f"{where}: not a table")
    if isinstance(row.get("name"), str):
        where = f"{source}: run {row['name']!r}"
    top = _fields(
        {k: v for k, v in row.items() if k not in ("model", "layout", "published")},
        "", where, _TOP, {},
    )  # fmt: skip
    for section in ("model", "layout", "published"):
        if not isinstance(row.get(section), dict):
            raise PublishedError(f"{where}: [run.{section}] is missing")
    model = _fields(row["model"], "model.", where, _MODEL, _MODEL_OPTIONAL)
    shape = [name for name in model.get("fields", {}) if name in _SHAPE_FIELDS]
    if shape:
        raise PublishedError(
            f"{where}: model.fields.{shape[0]} is the row's own shape or layout (model.layers, "
            "hidden, heads, query_groups, ffn, vocab, dropout; layout.seq_length, recompute)"
        )
    try:  # each field known and of its type, as a config file's
        apply_sections(Config(), {"model": model.get("fields", {})}, f"{where}: model.fields")
    except ConfigError as e:
        raise PublishedError(str(e)) from e
    lay = _fields(row["layout"], "layout.", where, _LAYOUT, _LAYOUT_OPTIONAL)
    pub = _fields(row["published"], "published.", where, _PUBLISHED, _PUBLISHED_OPTIONAL)
    _choice(top["use"], USES, where, "use")
    _choice(model["kind"], KINDS, where, "model.kind")
    _choice(lay["precision"], PRECISIONS, where, "layout.precision")
    _choice(lay["recompute"], RECOMPUTE, where, "layout.recompute")
    _choice(lay["sharding"], SHARDING, where, "layout.sharding")
    _choice(pub["metric"], METRICS, where, "published.metric")
    _choice(lay["gpu"], tuple(gpus), where, "layout.gpu")
    if "attention" in lay:
        _choice(lay["attention"], tuple(ATTENTION_IMPLEMENTATIONS), where, "layout.attention")
        profile = builtin_profile(gpus[lay["gpu"]].profile)
        if _flash(lay["attention"]) and not profile.attention_tflops:
            raise PublishedError(
                f"{where}: layout.attention = {lay['attention']!r} is a flash kernel, which "
                f"profile {profile.name} (of layout.gpu = {lay['gpu']!r}) cannot time: it has "
                "no attention_tflops"
            )
    try:  # a precision its GPU and profile can time (fp8: its peak and GEMMs' efficiency)
        gpu = gpus[lay["gpu"]]
        Costs(gpu, builtin_profile(gpu.profile), lay["precision"])
    except ValueError as e:
        raise PublishedError(f"{where}: layout.precision = {lay['precision']!r}: {e}") from e
    if lay["recompute"] == "op_selective" and (
        model["kind"] != "llama" or lay["tp"] != 1 or lay.get("cp", 1) != 1
    ):
        raise PublishedError(
            f"{where}: layout.recompute = 'op_selective' is torchtitan's policy for its Llama "
            f"block at tp 1 and cp 1 (accounting.RECOMPUTE_IMPLEMENTATIONS), not model.kind "
            f"{model['kind']!r} at tp {lay['tp']}, cp {lay.get('cp', 1)}"
        )
    vpp = lay.get("vpp", 1)
    layout = Layout(
        tp=lay["tp"],
        pp=lay["pp"],
        dp=lay["dp"],
        vpp=vpp,
        cp=lay.get("cp", 1),
        ep=lay.get("ep", 1),
        etp=lay.get("etp"),
        micro_batch=lay["micro_batch"],
        recompute=lay["recompute"],
        sequence_parallel=lay.get("sequence_parallel", False),
        distributed_optimizer=lay["sharding"] == "optimizer",
        fsdp=lay["sharding"] == "full",
        schedule="interleaved" if vpp > 1 else "1f1b",
        pipeline_layout=lay.get("pipeline_layout"),
    )
    # what apply_layout would quietly drop at another sharding
    for name, sharding in (
        ("reduce_every_microbatch", "full"),
        ("overlap_param_gather", "optimizer"),
    ):
        if lay.get(name) and lay["sharding"] != sharding:
            raise PublishedError(
                f"{where}: layout.{name} = true is for sharding = {sharding!r}, not "
                f"{lay['sharding']!r}"
            )
    if layout.gpus != lay["gpus"]:
        raise PublishedError(
            f"{where}: layout.gpus = {lay['gpus']} but tp x cp x pp x dp = {layout.gpus}"
        )
    run = PublishedRun(
        **top,
        model=model,
        gpu=lay["gpu"],
        gpus=lay["gpus"],
        layout=layout,
        global_batch=lay["global_batch"],
        seq_length=lay["seq_length"],
        precision=lay["precision"],
        metric=pub["metric"],
        value=pub["value"],
        definition=pub["definition"],
        assumed=tuple(pub.get("assumed", ())),
        parallel={name: lay[name] for name in _PARALLEL_FIELDS if name in lay},
        training={name: lay[name] for name in _TRAINING_FIELDS if name in lay},
        gpu_memory_gib=lay.get("gpu_memory_gib"),
        attention=lay.get("attention"),
        plan_memory_over=lay.get("plan_memory_over"),
    )
    try:  # the same checks a run of this config gets before any worker starts
        from megatrain.plan.layout import apply_layout

        validate(apply_layout(run.config(), layout), world_size=layout.gpus)
    except ConfigError as e:
        raise PublishedError(f"{where}: not a valid layout for its model: {e}") from e
    return run


def load_runs(path: str | Path | None = None) -> list[PublishedRun]:
    """The runs of `path` (default: the package's published_runs.toml), checked."""
    if path is None:
        text, source = (
            resources.files(__package__).joinpath("published_runs.toml").read_text(),
            "published_runs.toml",
        )
    else:
        path = Path(path)
        if not path.is_file():
            raise PublishedError(f"published runs file {path} does not exist")
        text, source = path.read_text(), str(path)
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise PublishedError(f"{source}: not valid TOML: {e}") from e
    rows = data.get("run")
    if not isinstance(rows, list) or not rows:
        raise PublishedError(f"{source}: no [[run]] tables")
    gpus = load_gpus()
    runs = [_run(row, i, source, gpus) for i, row in enumerate(rows)]
    names = [r.name for r in runs]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise PublishedError(f"{source}: run name {twice[0]!r} appears twice")
    return runs


def predicted(run: PublishedRun, result: Estimate, gpu: Gpu) -> float:
    """The planner's number for `run.metric` from its estimate `result`."""
    if run.metric == "tokens_per_s_per_gpu":
        return run.global_batch * run.seq_length / (result.time["total"] * run.gpus)
    if run.metric == "hardware_tflops_per_gpu":
        return result.tflops_per_gpu
    return result.mfu * gpu.base_peak_flops(run.precision) / 1e12


def run_gpu(run: PublishedRun) -> Gpu:
    """The gpus.toml entry `run` ran on, running the attention implementation it ran."""
    gpu = load_gpus()[run.gpu]
    return replace(gpu, attention=run.attention) if run.attention else gpu


def predict(run: PublishedRun, profile: Profile | None = None) -> tuple[float, Estimate]:
    """(the planner's number for `run.metric` at the run's layout, the whole estimate), with
    `profile`, else the profile the run's GPU names in gpus.toml."""
    gpu = run_gpu(run)
    result = estimate(
        run.config(), run.layout, gpu, profile or builtin_profile(gpu.profile),
        run.model["vocab"], run.global_batch,
    )  # fmt: skip
    if run.gpu_memory_gib:  # the run's GPUs held other than the entry's memory
        result.fits = result.memory["total"] <= (1 - HEADROOM) * run.gpu_memory_gib * GIB
    return predicted(run, result, gpu), result


def _flash(attention: str) -> bool:
    """Whether an attention implementation is a flash kernel (timed at attention_tflops)."""
    return ATTENTION_IMPLEMENTATIONS[attention] == "flash"


def check_rows_summary(gpu: Gpu, profile: Profile, tolerance: float = 0.15) -> dict:
    """How far a plan on `gpu` with `profile` is off the published runs it was not fitted to:
    the "check" rows on GPUs of `gpu`'s generation (those naming the same gpus.toml profile),
    each predicted with `profile`; how many are within `tolerance` and the median absolute
    error (None without rows), and the rows beyond it ("off": {"run", "ratio"}, the ratio
    predicted / published, the worst first).  Rows on flash-attention GPUs are left out (and
    counted) when `profile` has no attention_tflops to time them."""
    table = load_gpus()
    same = [r for r in load_runs() if r.use == "check" and table[r.gpu].profile == gpu.profile]
    runs = [r for r in same if profile.attention_tflops or not _flash(run_gpu(r).attention)]
    ratios = {r.name: predict(r, profile)[0] / r.value for r in runs}
    errors = [abs(ratio - 1) for ratio in ratios.values()]
    median = statistics.median(errors) if errors else None
    off = [(name, ratio) for name, ratio in ratios.items() if abs(ratio - 1) > tolerance]
    return {
        "generation": gpu.profile,
        "rows": len(runs),
        "within": len(runs) - len(off),
        "tolerance": tolerance,
        "median_abs_error": median,
        "gpus": sorted({r.gpu for r in runs}),
        "left_out": len(same) - len(runs),
        "off": [
            {"run": name, "ratio": ratio}
            for name, ratio in sorted(off, key=lambda item: -abs(item[1] - 1))
        ],
    }
