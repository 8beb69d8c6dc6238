"""benchmarks/gpu_rows.py: a bench_gpu.py record becomes a row of the published-runs table that
megatrain.plan.published reads as the table's own, and is set beside the plan.

The records are written here in the shape bench_gpu.py's main() writes ("when", "machine",
"shape", "method", and per model the summary with tokens_per_s_median)."""

import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_rows  # noqa: E402

from megatrain.plan.published import load_runs, predict  # noqa: E402

TABLE = ROOT / "packages/megatrain/src/megatrain/plan/published_runs.toml"


def record(**changes) -> dict:
    """A bench_gpu.py record of Llama 3 8B's shape at 4 layers on one H100."""
    shape = {
        "config": "pipelines/models/llama3-8b.toml",
        "kind": "llama",
        "num_query_groups": 8,
        "num_layers": 4,
        "hidden_size": 4096,
        "num_attention_heads": 32,
        "ffn_hidden_size": 14336,
        "num_moe_experts": None,
        "moe_router_topk": None,
        "moe_ffn_hidden_size": None,
        "seq_length": 8192,
        "vocab_size": 128256,
        "vocab_size_padded": 128256,
        "micro_batch_size": 1,
        "global_batch_size": 1,
        "tokens_per_step": 8192,
        "precision": "bf16",
        "recompute": "none",
        "compile": False,
        "levers": {
            "fused_linear_cross_entropy": True,
            "gradient_accumulation_fusion": True,
            "one_sync_per_iteration": True,
        },
        "hidden_dropout": 0.0,
        "attention_dropout": 0.0,
    }
    out = {
        "benchmark": "gpu",
        "when": "2026-11-27T10:00:00+00:00",
        "machine": {"device": "NVIDIA H100 80GB HBM3", "torch": "2.13.0"},
        "shape": shape,
        "method": {"device": "cuda:0", "warmup_steps": 2, "timed_steps": 5},
        "megatrain": {"tokens_per_s_median": 30000.0, "ms_per_step_median": 273.0},
        "hf": {"tokens_per_s_median": 20000.0},
    }
    for path, value in changes.items():
        section, key = path.split("__")
        (shape if section == "shape" else out[section])[key] = value
    return out


def write(tmp_path: Path, name: str, data: dict) -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return path


def test_a_record_is_a_row_the_table_reads(tmp_path):
    text = gpu_rows.rows([write(tmp_path, "gpu-llama.json", record())])
    path = tmp_path / "rows.toml"
    path.write_text(text)
    (run,) = load_runs(path)
    assert run.use == "check" and run.gpu == "h100-80gb" and run.gpus == 1
    assert run.source == "measured by benchmarks/bench_gpu.py on NVIDIA H100 80GB HBM3 2026-11-27"
    assert "gpu-llama.json" in run.where and "5 timed steps" in run.where
    assert run.model == {
        "kind": "llama", "layers": 4, "hidden": 4096, "heads": 32, "query_groups": 8,
        "ffn": 14336, "vocab": 128256, "dropout": 0.0,
    }  # fmt: skip
    layout = run.layout
    assert (layout.tp, layout.pp, layout.dp, layout.micro_batch) == (1, 1, 1, 1)
    assert layout.recompute == "none" and layout.sharding == "none"
    assert (run.seq_length, run.global_batch, run.precision) == (8192, 1, "bf16")
    assert run.config().training.fused_linear_cross_entropy
    assert (run.metric, run.value) == ("tokens_per_s_per_gpu", 30000.0)
    # GPT-2's shape: one key/value group a head is no query_groups field; its dropout kept
    gpt = record(
        shape__config="pipelines/models/gpt2-1.2b.toml", shape__kind="gpt",
        shape__num_query_groups=None, shape__num_layers=40, shape__hidden_size=1536,
        shape__num_attention_heads=16, shape__ffn_hidden_size=6144, shape__seq_length=1024,
        shape__vocab_size=50257, shape__vocab_size_padded=50304, shape__micro_batch_size=8,
        shape__global_batch_size=8, shape__hidden_dropout=0.1, shape__attention_dropout=0.1,
    )  # fmt: skip
    path.write_text(gpu_rows.rows([write(tmp_path, "gpu.json", gpt)]))
    (run,) = load_runs(path)
    assert "query_groups" not in run.model and run.model["dropout"] == 0.1
    assert run.name == "bench-gpu-gpt2-1.2b-40l-1xh100-80gb-2026-11-27"


def test_an_fp8_measurement_is_a_second_row_in_fp8(tmp_path):
    """bench_gpu.py --fp8's "megatrain-fp8" (the same shape, the layers' GEMMs in float8) is a
    row of its own, precision fp8, compiled as the record's shape says; a skipped or emulated
    one is none."""
    fp8 = {"tokens_per_s_median": 36000.0, "precision": "fp8 (torchao float8 training)"}
    data = record(shape__compile=True)
    data["megatrain-fp8"] = fp8
    path = tmp_path / "rows.toml"
    path.write_text(gpu_rows.rows([write(tmp_path, "gpu.json", data)]))
    bf16, float8 = load_runs(path)
    assert (bf16.precision, bf16.value) == ("bf16", 30000.0)
    assert (float8.precision, float8.value) == ("fp8", 36000.0)
    assert float8.name == bf16.name + "-fp8" and "megatrain-fp8.tokens_per_s_median" in float8.where
    assert bf16.config().training.compile and float8.config().training.compile
    assert float8.layout == bf16.layout
    planned = {run.precision: predict(run)[0] for run in (bf16, float8)}
    assert planned["fp8"] > planned["bf16"]  # compiled float8 GEMMs: faster than bf16's
    for other in ({"skipped": True, "reason": "no float8 GEMMs"},
                  {**fp8, "precision": "fp8 (torchao float8 training, emulated)"}):  # fmt: skip
        data["megatrain-fp8"] = other
        path.write_text(gpu_rows.rows([write(tmp_path, "gpu.json", data)]))
        assert [run.precision for run in load_runs(path)] == ["bf16"]


def test_the_gpu_is_the_table_entry_the_device_name_says(tmp_path):
    gpus = {key: None for key in ("v100-32gb", "a100-40gb", "a100-80gb", "h100-80gb", "h200-141gb")}
    assert gpu_rows.gpu_key("NVIDIA A100-SXM4-80GB", gpus) == "a100-80gb"
    assert gpu_rows.gpu_key("NVIDIA H200", gpus) == "h200-141gb"
    assert gpu_rows.gpu_key("Tesla V100-SXM2-32GB", gpus) == "v100-32gb"
    with pytest.raises(gpu_rows.RowError, match="pass --gpu KEY"):
        gpu_rows.gpu_key("NVIDIA A100-PCIE", gpus)  # 40 or 80 GB: the name does not say
    with pytest.raises(gpu_rows.RowError, match="is none of the GPU table"):
        gpu_rows.gpu_key("NVIDIA H100 NVL 94GB", gpus)  # not the table's 80 GB part
    path = write(tmp_path, "gpu.json", record(machine__device="NVIDIA A100-PCIE"))
    assert 'gpu = "a100-80gb"' in gpu_rows.rows([path], gpu="a100-80gb")


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"megatrain__skipped": True, "megatrain__reason": "OOM"}, "megatrain was skipped (OOM)"),
        ({"shape__num_moe_experts": 8}, "a mixture of experts"),
        ({"shape__attention_dropout": 0.1}, "a row has one dropout"),
    ],
)
def test_a_record_that_is_no_row_is_refused_naming_why(tmp_path, changes, message):
    path = write(tmp_path, "gpu.json", record(**changes))
    with pytest.raises(gpu_rows.RowError, match=re.escape(message)):
        gpu_rows.rows([path])
    data = record()
    del data["megatrain"]["tokens_per_s_median"]
    with pytest.raises(gpu_rows.RowError, match=r"no megatrain\.tokens_per_s_median"):
        gpu_rows.rows([write(tmp_path, "cut.json", data)])


def test_main_prints_writes_appends_and_checks_against_the_plan(tmp_path, capsys):
    bench = write(tmp_path, "gpu-llama.json", record())
    (run,) = load_runs(_rows_file(tmp_path, bench))
    planned, _ = predict(run)
    out = tmp_path / "rows.toml"
    assert gpu_rows.main([str(bench), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert f"plan {planned:.0f}, ratio {planned / 30000.0:.2f}" in printed
    # --check fails exactly when the plan is off by more than the tolerance
    off = abs(planned / 30000.0 - 1)
    assert gpu_rows.main([str(bench), "--check", "--tolerance", f"{off * 1.01}"]) == 0
    assert gpu_rows.main([str(bench), "--check", "--tolerance", f"{off * 0.99}"]) == 1
    # appended to a copy of the table: read back with every other row; twice is refused
    table = tmp_path / "published_runs.toml"
    table.write_text(TABLE.read_text())
    rows = len(load_runs(table))
    assert gpu_rows.main([str(bench), "--append", str(table)]) == 0
    assert [r.name for r in load_runs(table)][-1] == run.name and len(load_runs(table)) == rows + 1
    before = table.read_text()
    assert gpu_rows.main([str(bench), "--append", str(table)]) == 2
    assert "appears twice" in capsys.readouterr().err and table.read_text() == before


def _rows_file(tmp_path: Path, bench: Path) -> Path:
    path = tmp_path / "one.toml"
    path.write_text(gpu_rows.rows([bench]))
    return path
