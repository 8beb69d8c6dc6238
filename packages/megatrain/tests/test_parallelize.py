"""`parallelize.parallelize_model`: every step applied once, in the order its docstring gives, and
without a run config only the steps the model's own config names."""

from functools import partial
from pathlib import Path

import pytest
import torch

from megatrain import parallelize
from megatrain.config import load_config
from megatrain.models import build_model_chunks, model_config

MODELS = Path(__file__).resolve().parents[3] / "pipelines" / "models"
# The order parallelize/__init__.py documents (steps 1-9; 8, the seeds, is not an apply_*).
ORDER = [
    "apply_expert_parallel",
    "apply_context_parallel",
    "apply_tp_comm_overlap",
    "apply_recompute",
    "apply_float8",
    "apply_compile",
    "apply_fsdp",
    "apply_cuda_graphs",
]


def _recording(monkeypatch) -> list:
    calls = []
    for name in [*ORDER, "apply_ddp"]:
        real = getattr(parallelize, name)

        def record(chunk, *args, _name=name, _real=real, **kwargs):
            calls.append(_name)
            if _name in ("apply_fsdp", "apply_ddp", "apply_cuda_graphs", "apply_compile"):
                return chunk  # recorded only: the order is what is under test
            return _real(chunk, *args, **kwargs)

        monkeypatch.setattr(parallelize, name, record)
    return calls


def test_every_step_once_in_the_documented_order(gloo_world_of_one, monkeypatch):
    config = load_config(
        MODELS / "gpt2-tiny.toml",
        [
            'model.recompute="selective"',
            'training.precision="fp8"',
            "training.fp8_emulate=true",
            "training.compile=true",
            "training.cuda_graphs=true",
            'parallel.data_parallel_sharding="full"',
        ],
    )
    cfg = model_config(config, 1000)
    cfg.tp_comm_overlap = True  # sequence parallelism's overlap needs tp > 1 in a config
    calls = _recording(monkeypatch)
    (chunk,) = parallelize.parallelize_model(
        build_model_chunks("gpt", cfg, 1, dtype=torch.bfloat16), config
    )
    assert calls == ORDER
    assert isinstance(chunk.layers["0"].attention.core_attention, partial)  # selective


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_without_a_run_config_only_the_models_own_steps(gloo_world_of_one, monkeypatch, recompute):
    config = load_config(MODELS / "gpt2-tiny.toml", [f'model.recompute="{recompute}"'])
    calls = _recording(monkeypatch)
    (chunk,) = parallelize.parallelize_model(build_model_chunks("gpt", model_config(config, 1000)))
    assert calls == ["apply_expert_parallel", "apply_recompute"]
    attention = chunk.layers["0"].attention
    assert (attention.core_attention == attention.core) == (recompute != "selective")
    assert (chunk.checkpointed_layer is not None) == (recompute == "full")
