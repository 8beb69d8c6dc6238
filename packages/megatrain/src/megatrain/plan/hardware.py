"""The hardware a plan is for: the GPU table (gpus.toml) and the time model's constants.

A `Gpu` is one row of the table: memory, dense peak per precision, memory bandwidth, and the
bandwidths of its links inside and between nodes.  A `Profile` holds the handful of
constants the time model (cost_model.py) needs besides the data sheet: how close to peak a
large GEMM runs and what fixed time each one costs, how much memory traffic a layer's
non-GEMM ops make, and how close to the link bandwidth collectives run and their fixed
latency.  The built-in profile is gpus.toml's [profile]; `megatrain plan --calibrate`
writes one measured on the machine at hand (calibrate.py), a JSON file that may carry the
measured device as well.
"""

import json
import sys
from dataclasses import asdict, dataclass, field, replace
from importlib import resources
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

GIB = 2**30
PRECISIONS = ("fp32", "bf16", "fp16")
_GPU_FIELDS = (
    "name",
    "memory_gib",
    "peak_tflops",
    "hbm_gbps",
    "intra_node_gbps",
    "inter_node_gbps",
    "gpus_per_node",
)
# Optional: the attention kernel a plan assumes on this GPU ("unfused" when not given) and,
# for "flash", the fraction of the 16-bit peak its FLOPs run at.
_OPTIONAL_FIELDS = ("attention", "attention_efficiency")


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
    # newer: O(s h) bytes, the causal half skipped) or "unfused" (the s x s scores written and
    # read, the 2019 kernels); `attention_efficiency` the flash kernel's fraction of peak.
    attention: str = "unfused"
    attention_efficiency: float | None = None

    @property
    def memory_bytes(self) -> float:
        return self.memory_gib * GIB

    def peak_flops(self, precision: str) -> float:
        """Dense peak FLOP/s for a training precision; ValueError if the GPU has none."""
        if precision not in self.peak_tflops:
            raise ValueError(
                f"{self.key} has no {precision} peak in the GPU table (it lists "
                f"{', '.join(self.peak_tflops)})"
            )
        return self.peak_tflops[precision] * 1e12


class HardwareError(ValueError):
    """A GPU table or profile that cannot be used; the message says which file and field."""


def check_attention(attention: str, efficiency: float | None) -> None:
    """ValueError naming the field unless `attention` is "flash" with an efficiency in
    (0, 1] or "unfused"."""
    if attention not in ("flash", "unfused"):
        raise ValueError(f'attention must be "flash" or "unfused", not {attention!r}')
    if attention == "flash" and not (isinstance(efficiency, int | float) and 0 < efficiency <= 1):
        raise ValueError(
            "attention_efficiency (the flash kernel's fraction of peak, in (0, 1]) is "
            f'needed for attention = "flash", not {efficiency!r}'
        )


def with_attention(gpu: Gpu, attention: str | None) -> Gpu:
    """`gpu` with the attention kernel a user asked for (`megatrain plan --attention`);
    HardwareError when "flash" is asked of a GPU whose entry gives no attention_efficiency."""
    if attention is None:
        return gpu
    try:
        check_attention(attention, gpu.attention_efficiency)
    except ValueError as e:
        raise HardwareError(f"--attention {attention} on {gpu.key}: {e}") from e
    return replace(gpu, attention=attention)


def _gpu(key: str, entry: dict, source: str) -> Gpu:
    missing = [f for f in _GPU_FIELDS if f not in entry]
    unknown = [f for f in entry if f not in _GPU_FIELDS + _OPTIONAL_FIELDS]
    if missing or unknown:
        raise HardwareError(
            f"{source}: [gpu.{key}] "
            + (f"misses {', '.join(missing)}" if missing else f"has unknown {', '.join(unknown)}")
            + f"; a GPU has {', '.join(_GPU_FIELDS)}"
        )
    bad = [p for p in entry["peak_tflops"] if p not in PRECISIONS]
    if bad:
        raise HardwareError(
            f"{source}: [gpu.{key}] peak_tflops names {', '.join(bad)}; precisions are "
            f"{', '.join(PRECISIONS)}"
        )
    for name in ("memory_gib", "hbm_gbps", "intra_node_gbps", "inter_node_gbps", "gpus_per_node"):
        if not isinstance(entry[name], int | float) or entry[name] <= 0:
            raise HardwareError(f"{source}: [gpu.{key}] {name} must be a positive number")
    try:
        check_attention(entry.get("attention", "unfused"), entry.get("attention_efficiency"))
    except ValueError as e:
        raise HardwareError(f"{source}: [gpu.{key}] {e}") from e
    return Gpu(key=key, **{**entry, "peak_tflops": dict(entry["peak_tflops"])})


def _read_toml(text: str, source: str) -> dict:
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise HardwareError(f"{source}: not valid TOML: {e}") from e


def _builtin() -> dict:
    return _read_toml(resources.files(__package__).joinpath("gpus.toml").read_text(), "gpus.toml")


def load_gpus(extra: str | Path | None = None) -> dict[str, Gpu]:
    """The GPU table: gpus.toml, then the [gpu.*] entries of `extra` (added or replacing)."""
    tables = [(_builtin().get("gpu", {}), "gpus.toml")]
    if extra is not None:
        path = Path(extra)
        if not path.is_file():
            raise HardwareError(f"GPU file {path} does not exist")
        data = _read_toml(path.read_text(), str(path))
        if not data.get("gpu"):
            raise HardwareError(f"{path}: no [gpu.<key>] tables (see megatrain/plan/gpus.toml)")
        tables.append((data["gpu"], str(path)))
    return {
        key: _gpu(key, entry, source) for table, source in tables for key, entry in table.items()
    }


@dataclass(frozen=True)
class Profile:
    """The time model's constants (gpus.toml's [profile] says what each is)."""

    gemm_efficiency: float
    gemm_overhead_us: float
    elementwise_passes: float
    collective_efficiency: float
    collective_latency_us: float
    source: str = "built-in (gpus.toml [profile], fitted to the paper's V100 runs)"
    # A calibrated profile's own device (measured peak, memory and link bandwidths), which
    # a plan without --gpu runs on; None for the built-in one.
    device: Gpu | None = None
    measurements: dict = field(default_factory=dict)

    @property
    def gemm_overhead_s(self) -> float:
        return self.gemm_overhead_us * 1e-6

    @property
    def collective_latency_s(self) -> float:
        return self.collective_latency_us * 1e-6


CONSTANTS = (
    "gemm_efficiency",
    "gemm_overhead_us",
    "elementwise_passes",
    "collective_efficiency",
    "collective_latency_us",
)


def builtin_profile() -> Profile:
    section = _builtin()["profile"]
    return Profile(**{name: float(section[name]) for name in CONSTANTS})


def save_profile(profile: Profile, path: str | Path) -> None:
    data = asdict(profile)
    Path(path).write_text(json.dumps(data, indent=2) + "\n")


def load_profile(path: str | Path) -> Profile:
    """A profile `megatrain plan --calibrate --out` wrote."""
    path = Path(path)
    if not path.is_file():
        raise HardwareError(f"profile {path} does not exist (megatrain plan --calibrate --out)")
    try:
        data = json.loads(path.read_text())
        missing = [name for name in CONSTANTS if name not in data]
        if missing:
            raise HardwareError(f"profile {path} misses {', '.join(missing)}")
        device = data.get("device")
        return Profile(
            **{name: float(data[name]) for name in CONSTANTS},
            source=f"{path}: {data.get('source', 'a calibrated profile')}",
            device=_gpu(device.pop("key"), device, str(path)) if device else None,
            measurements=data.get("measurements", {}),
        )
    except (json.JSONDecodeError, AttributeError, KeyError, TypeError) as e:
        raise HardwareError(f"profile {path}: not a profile megatrain plan wrote ({e})") from e


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
