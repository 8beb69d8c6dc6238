"""Other training stacks that bench_gpu.py runs beside ours, on the same batches and shape.

Each peer module has `build(config, model_config, batches, device, precision, seed) -> Trainer`:
`config` is our run's `megatrain.config.Config`, `model_config` the `TransformerConfig` our run
built (the vocabulary padded as we pad it), `batches` a `Recorder` over the very batches ours
trained on.  bench_gpu.py times `Trainer.step` as it times ours and HF's, then calls `close`.

A peer's package is not a dependency of megasuite: it is installed where the benchmark runs
(scripts/fetch_gpu_wheels.py, scripts/install_gpu_wheels.sh).  `unavailable` says why one cannot
run here, so bench_gpu.py records the reason instead of failing.
"""

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field

# Our name for each peer: (the package it imports, this package's module for it).
PEERS = {
    "megatron-core": ("megatron.core", "peers.megatron_core"),
    "torchtitan": ("torchtitan", "peers.torchtitan"),
}


@dataclass
class Trainer:
    """One peer's model, optimizer and step, built; what bench_gpu.py reports of it."""

    step: Callable[[], dict]  # one optimizer step on the next batch: {"loss": float, ...}
    close: Callable[[], None]  # frees the model, optimizer and any global state it set up
    parameters: int
    model_config: object  # what it runs, as our TransformerConfig: its model FLOPs
    recompute: str  # none | selective | full, as our accounting counts it
    precision: str
    description: str  # what exactly was run
    details: dict = field(default_factory=dict)


def unavailable(name: str) -> str | None:
    """Why peer `name` cannot run in this interpreter, or None when its package imports."""
    package = PEERS[name][0]
    try:
        importlib.import_module(package)
    except ImportError as e:
        return (
            f"{package} does not import ({type(e).__name__}: {e}); install the peers with "
            "scripts/fetch_gpu_wheels.py and scripts/install_gpu_wheels.sh"
        )
    return None


def build(name: str, *args, **kwargs) -> Trainer:
    return importlib.import_module(PEERS[name][1]).build(*args, **kwargs)
