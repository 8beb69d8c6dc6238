"""The hardware a plan is for: the GPU table (gpus.toml) and the time model's profiles.

A `Gpu` is one row of the table: memory, dense peak per precision, memory bandwidth, the
bandwidths of its links inside and between nodes, the attention kernel it runs and the name
of its profile.  A `Profile` holds what the time model (cost_model.py) needs besides the
data sheet: how close to peak GEMMs run (by size, where known) and what fixed time each one
costs, the flash attention kernel's rate by sequence length, the fraction of the memory
bandwidth element-wise kernels reach and how much traffic a layer's non-GEMM ops make, and
how close to the link bandwidth collectives run and their fixed latency.

The built-in profiles are gpus.toml's [profile.<name>] tables, one per GPU generation:
"volta" fitted to the paper's 2019 V100 runs, the others from published kernel figures
(each number's source is in the file).  A plan uses `--profile FILE` when given, else the
profile its GPU's entry names.  `megatrain plan --calibrate` writes one measured on the
machine at hand (calibrate.py), a JSON file that may carry the measured device as well.
"""

import itertools
import json
import math
import sys
from dataclasses import asdict, dataclass, field, replace
from importlib import resources
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

GIB = 2**30
PRECISIONS = ("fp32", "bf16", "fp16", "fp8")
# What runs in a precision besides its own GEMMs: fp8 trains with bf16 parameters and
# activations, only its layers' linears in float8 (the attention core, the output layer and
# every other op in bf16), and `megatrain run` (as torchtitan) gives its MFU of the bf16 peak.
BASE_PRECISION = {"fp8": "bf16"}
_GPU_FIELDS = (
    "name",
    "memory_gib",
    "peak_tflops",
    "hbm_gbps",
    "intra_node_gbps",
    "inter_node_gbps",
    "gpus_per_node",
)
# Optional: the attention kernel a plan assumes on this GPU ("unfused" when not given) and
# the name of its profile (required in gpus.toml; a --gpu-file entry without one keeps the
# profile of the built-in entry it replaces, else gets DEFAULT_PROFILE).
_OPTIONAL_FIELDS = ("attention", "profile")
DEFAULT_PROFILE = "volta"


@dataclass(frozen=True)
class Gpu:
    key: str
    name: str
    memory_gib: float
    peak_tflops: dict  # precision -> dense TFLOP/s
    hbm_gbps: float
    intra_node_gbps: float  # one direction, per GPU
    inter_node_gbps: float  # one direction, per GPU (its share of the node's adapters)
    gpus_per_node: int
    # The attention core's kernel: "flash" (fused, what SDPA runs in 16 bits on Ampere and
    # newer: O(s h) bytes, the causal half skipped, at its profile's `attention_tflops`) or
    # "unfused" (the s x s scores written and read, the 2019 kernels).
    attention: str = "unfused"
    profile: str = DEFAULT_PROFILE  # a [profile.<name>] of gpus.toml

    @property
    def memory_bytes(self) -> float:
        return self.memory_gib * GIB

    def peak_flops(self, precision: str) -> float:
        """Dense peak FLOP/s for a training precision; ValueError if the GPU has none."""
        if precision not in self.peak_tflops:
            why = (
                ": fp8 trains with float8 GEMMs, which need Hopper or newer (compute "
                "capability 8.9+); plan it in bf16, or on such a GPU"
                if precision == "fp8"
                else ""
            )
            raise ValueError(
                f"{self.key} has no {precision} peak in the GPU table (it lists "
                f"{', '.join(self.peak_tflops)}){why}"
            )
        return self.peak_tflops[precision] * 1e12

    def base_peak_flops(self, precision: str) -> float:
        """The peak of what a run in `precision` does outside its own GEMMs, and that its MFU
        is a fraction of (`BASE_PRECISION`: bf16's for fp8)."""
        return self.peak_flops(BASE_PRECISION.get(precision, precision))


class HardwareError(ValueError):
    """A GPU table or profile that cannot be used; the message says which file and field."""


def log_interpolate(points: tuple, x: float) -> float:
    """y at x on the curve through `points` ((x, y), ... with x ascending): linear in log x
    between two points, flat beyond the first and the last."""
    if x <= points[0][0]:
        return points[0][1]
    for (x0, y0), (x1, y1) in itertools.pairwise(points):
        if x <= x1:
            return y0 + (y1 - y0) * math.log(x / x0) / math.log(x1 / x0)
    return points[-1][1]


@dataclass(frozen=True)
class Profile:
    """The time model's constants (gpus.toml's profiles say what each is)."""

    gemm_efficiency: float
    gemm_overhead_us: float
    elementwise_passes: float
    collective_efficiency: float
    collective_latency_us: float
    hbm_efficiency: float = 1.0
    # ((GFLOP of one GEMM, fraction of peak), ...): replaces gemm_efficiency when given
    gemm_efficiency_by_size: tuple = ()
    # ((sequence length, TFLOP/s), ...): the flash kernel, forward and backward
    attention_tflops: tuple = ()
    # the fraction of the fp8 peak a large float8 GEMM reaches; None: fp8 cannot be timed
    fp8_gemm_efficiency: float | None = None
    name: str = DEFAULT_PROFILE
    source: str = "gpus.toml [profile.volta]"
    measured: bool = False  # calibrated here, not published figures or a fit to them
    # A calibrated profile's own device (measured peak, memory and link bandwidths), which
    # a plan without --gpu runs on; None for the built-in ones.
    device: Gpu | None = None
    measurements: dict = field(default_factory=dict)

    @property
    def gemm_overhead_s(self) -> float:
        return self.gemm_overhead_us * 1e-6

    @property
    def collective_latency_s(self) -> float:
        return self.collective_latency_us * 1e-6

    def gemm_fraction(self, flops: float) -> float:
        """The fraction of peak a GEMM of `flops` FLOPs runs at."""
        if not self.gemm_efficiency_by_size:
            return self.gemm_efficiency
        return log_interpolate(self.gemm_efficiency_by_size, flops / 1e9)

    def fp8_fraction(self) -> float:
        """`fp8_gemm_efficiency`; ValueError naming the field when the profile has none."""
        if self.fp8_gemm_efficiency is None:
            raise ValueError(
                f"profile {self.name} has no fp8_gemm_efficiency: it cannot time float8 GEMMs "
                '(training.precision = "fp8"); add the fraction of the fp8 peak a large '
                "float8 GEMM reaches to the profile, or plan in bf16"
            )
        return self.fp8_gemm_efficiency

    def attention_flops(self, seq: int) -> float:
        """FLOP/s of the flash kernel at sequence length `seq`; ValueError without a curve."""
        if not self.attention_tflops:
            raise ValueError(
                f"profile {self.name} has no attention_tflops: it cannot time flash attention "
                "(--attention unfused, or a profile that measured it)"
            )
        return log_interpolate(self.attention_tflops, seq) * 1e12


# Every profile's numbers, then its curves (each optional) and the rest of a profile table.
CONSTANTS = (
    "gemm_efficiency",
    "gemm_overhead_us",
    "elementwise_passes",
    "collective_efficiency",
    "collective_latency_us",
    "hbm_efficiency",
)
# Optional numbers: a profile without one cannot time what it is for.
OPTIONAL_CONSTANTS = ("fp8_gemm_efficiency",)
_POSITIVE = ("gemm_efficiency", "collective_efficiency", "hbm_efficiency", "fp8_gemm_efficiency")
_CURVES = {  # field -> (what x is, what y is)
    "gemm_efficiency_by_size": ("GFLOP", "fraction of peak"),
    "attention_tflops": ("sequence length", "TFLOP/s"),
}
_PROFILE_FIELDS = (*CONSTANTS, *OPTIONAL_CONSTANTS, *_CURVES, "source", "measured")


def _number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _curve(value, name: str, where: str) -> tuple:
    """`value` as ((x, y), ...): pairs of positive numbers, x strictly ascending."""
    x_is, y_is = _CURVES[name]
    pairs = value if isinstance(value, list | tuple) else None
    if not pairs or not all(
        isinstance(p, list | tuple) and len(p) == 2 and all(_number(v) and v > 0 for v in p)
        for p in pairs
    ):
        raise HardwareError(
            f"{where} {name} must be a list of [{x_is}, {y_is}] pairs of positive numbers"
        )
    xs = [p[0] for p in pairs]
    if any(b <= a for a, b in itertools.pairwise(xs)):
        raise HardwareError(f"{where} {name}: the {x_is}s must ascend, not {xs}")
    return tuple((float(x), float(y)) for x, y in pairs)


def _fields(where: str, table: dict, required: list, known: tuple, kind: str) -> None:
    """HardwareError naming `where` unless `table` has every `required` field and no field
    outside `known` (a `kind`'s fields, listed in the message)."""
    missing = [f for f in required if f not in table]
    unknown = [f for f in table if f not in known]
    if missing or unknown:
        raise HardwareError(
            f"{where} "
            + (f"misses {', '.join(missing)}" if missing else f"has unknown {', '.join(unknown)}")
            + f"; {kind} has {', '.join(known)}"
        )


def _profile(name: str, data: dict, where: str, extra: tuple = ()) -> Profile:
    """A profile from its table `data`; `where` names the file and table for errors."""
    if not isinstance(data, dict):
        raise HardwareError(f"{where} is not a table")
    _fields(where, data, [*CONSTANTS, "source", "measured"], _PROFILE_FIELDS + extra, "a profile")
    for f in (*CONSTANTS, *(f for f in OPTIONAL_CONSTANTS if data.get(f) is not None)):
        value = data[f]
        bad = not _number(value) or value < 0 or (f in _POSITIVE and value == 0)
        if bad:
            kind = "a positive number" if f in _POSITIVE else "a number >= 0"
            raise HardwareError(f"{where} {f} must be {kind}, not {value!r}")
    if not isinstance(data["source"], str) or not data["source"]:
        raise HardwareError(f"{where} source must say where the numbers come from")
    if not isinstance(data["measured"], bool):
        raise HardwareError(f"{where} measured must be true or false")
    return Profile(
        **{f: float(data[f]) for f in CONSTANTS},
        **{f: float(data[f]) for f in OPTIONAL_CONSTANTS if data.get(f) is not None},
        **{f: _curve(data[f], f, where) for f in _CURVES if f in data},
        name=name,
        source=data["source"],
        measured=data["measured"],
    )


def _gpu(key: str, entry: dict, source: str, profiles: dict, default: str | None) -> Gpu:
    """A GPU entry; `default`: its profile's name when the entry names none (None: required)."""
    where = f"{source}: [gpu.{key}]"
    required = [*_GPU_FIELDS, *(["profile"] if default is None else [])]
    _fields(where, entry, required, _GPU_FIELDS + _OPTIONAL_FIELDS, "a GPU")
    bad = [p for p in entry["peak_tflops"] if p not in PRECISIONS]
    if bad:
        raise HardwareError(
            f"{where} peak_tflops names {', '.join(bad)}; precisions are {', '.join(PRECISIONS)}"
        )
    for name in ("memory_gib", "hbm_gbps", "intra_node_gbps", "inter_node_gbps", "gpus_per_node"):
        if not _number(entry[name]) or entry[name] <= 0:
            raise HardwareError(f"{where} {name} must be a positive number")
    profile = entry.get("profile", default)
    if profile not in profiles:
        raise HardwareError(
            f"{where} profile = {profile!r} is not a profile of gpus.toml; known: "
            f"{', '.join(profiles)}"
        )
    gpu = Gpu(key=key, **{**entry, "peak_tflops": dict(entry["peak_tflops"]), "profile": profile})
    try:
        check_attention(gpu.attention, profiles[profile])
    except ValueError as e:
        raise HardwareError(f"{where} {e}") from e
    return gpu


# The attention kernels a GPU entry (and `megatrain plan --attention`) may name; published
# runs may name more implementations of them (accounting.ATTENTION_IMPLEMENTATIONS).
ATTENTION_CHOICES = ("flash", "unfused")


def check_attention(attention: str, profile: Profile) -> None:
    """ValueError naming the field unless `attention` is "unfused", or "flash" with a profile
    that gives the flash kernel's rate (`attention_tflops`)."""
    if attention not in ATTENTION_CHOICES:
        raise ValueError(f'attention must be "flash" or "unfused", not {attention!r}')
    if attention == "flash" and not profile.attention_tflops:
        raise ValueError(
            f'attention = "flash" needs a profile with attention_tflops (the flash kernel\'s '
            f"rate by sequence length); profile {profile.name} has none"
        )


def with_attention(gpu: Gpu, attention: str | None, profile: Profile | None = None) -> Gpu:
    """`gpu` with the attention kernel a user asked for (`megatrain plan --attention`), or its
    own; HardwareError when "flash" is planned with `profile` (default: the GPU's own) and
    that cannot time it."""
    attention = attention or gpu.attention
    try:
        check_attention(attention, profile or gpu_profile(gpu))
    except ValueError as e:
        raise HardwareError(f"attention {attention} on {gpu.key}: {e}") from e
    return gpu if attention == gpu.attention else replace(gpu, attention=attention)


def _read_toml(text: str, source: str) -> dict:
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise HardwareError(f"{source}: not valid TOML: {e}") from e


def _builtin() -> dict:
    return _read_toml(resources.files(__package__).joinpath("gpus.toml").read_text(), "gpus.toml")


def builtin_profiles() -> dict[str, Profile]:
    """gpus.toml's [profile.<name>] tables."""
    tables = _builtin().get("profile", {})
    return {name: _profile(name, t, f"gpus.toml: [profile.{name}]") for name, t in tables.items()}


def builtin_profile(name: str = DEFAULT_PROFILE) -> Profile:
    """gpus.toml's [profile.<name>] (by default "volta", the fit to the paper's V100 runs)."""
    profiles = builtin_profiles()
    if name not in profiles:
        raise HardwareError(f"no profile {name!r} in gpus.toml; known: {', '.join(profiles)}")
    return profiles[name]


def gpu_profile(gpu: Gpu) -> Profile:
    """The built-in profile `gpu`'s entry names."""
    return builtin_profile(gpu.profile)


def load_gpus(extra: str | Path | None = None) -> dict[str, Gpu]:
    """The GPU table: gpus.toml, then the [gpu.*] entries of `extra` (added or replacing; an
    entry naming no profile keeps the replaced entry's, else gets DEFAULT_PROFILE)."""
    profiles = builtin_profiles()
    gpus = {
        key: _gpu(key, entry, "gpus.toml", profiles, None)
        for key, entry in _builtin().get("gpu", {}).items()
    }
    if extra is not None:
        path = Path(extra)
        if not path.is_file():
            raise HardwareError(f"GPU file {path} does not exist")
        data = _read_toml(path.read_text(), str(path))
        if not data.get("gpu"):
            raise HardwareError(f"{path}: no [gpu.<key>] tables (see megatrain/plan/gpus.toml)")
        for key, entry in data["gpu"].items():
            default = gpus[key].profile if key in gpus else DEFAULT_PROFILE
            gpus[key] = _gpu(key, entry, str(path), profiles, default)
    return gpus


def save_profile(profile: Profile, path: str | Path) -> None:
    # what the profile has not (an empty curve, a missing optional number) is left out, as
    # load_profile reads it
    data = {k: v for k, v in asdict(profile).items() if k != "name" and v not in ((), None)}
    Path(path).write_text(json.dumps(data, indent=2) + "\n")


def load_profile(path: str | Path) -> Profile:
    """A profile `megatrain plan --calibrate --out` wrote; its name is the file's path."""
    path = Path(path)
    if not path.is_file():
        raise HardwareError(f"profile {path} does not exist (megatrain plan --calibrate --out)")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise HardwareError(f"profile {path}: not JSON ({e})") from e
    if not isinstance(data, dict):
        raise HardwareError(f"profile {path}: not a profile megatrain plan wrote (not an object)")
    profile = _profile(str(path), data, f"{path}: profile", extra=("device", "measurements"))
    device = data.get("device")
    if device is not None:
        if not isinstance(device, dict) or not isinstance(device.get("key"), str):
            raise HardwareError(f"{path}: profile device must be a GPU entry with its key")
        device = dict(device)
        device = _gpu(device.pop("key"), device, f"{path}: profile device", builtin_profiles(),
                      DEFAULT_PROFILE)  # fmt: skip
    measurements = data.get("measurements", {})
    if not isinstance(measurements, dict):
        raise HardwareError(f"{path}: profile measurements must be an object")
    return replace(profile, device=device, measurements=measurements)


def with_nodes_of(gpu: Gpu, gpus_per_node: int | None) -> Gpu:
    return gpu if gpus_per_node is None else replace(gpu, gpus_per_node=gpus_per_node)


def job_gpu(
    gpus: int,
    key: str | None,
    gpu_file: str | Path | None = None,
    nodes_of: int | None = None,
    profile: Profile | None = None,
) -> Gpu:
    """The GPU of a `megatrain plan` job: `key` in the GPU table (with `gpu_file`'s), else
    the measured device of `profile`; with `nodes_of` GPUs per node, and `gpus` a whole
    number of its nodes.  HardwareError (naming the flag) otherwise."""
    table = load_gpus(gpu_file)
    if key is None:
        if profile is None or profile.device is None:
            raise HardwareError(f"--gpu is required; known: {', '.join(table)}")
        gpu = profile.device
    elif key not in table:
        raise HardwareError(
            f"--gpu {key!r} is not in the GPU table; known: {', '.join(table)} "
            "(add one with --gpu-file)"
        )
    else:
        gpu = table[key]
    gpu = with_nodes_of(gpu, nodes_of)
    if gpus > gpu.gpus_per_node and gpus % gpu.gpus_per_node:
        raise HardwareError(
            f"--gpus {gpus} is not a whole number of nodes of {gpu.gpus_per_node} (--nodes-of)"
        )
    return gpu
