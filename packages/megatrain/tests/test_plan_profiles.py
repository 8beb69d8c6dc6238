"""The time model's profiles (issue 50 items 3 and 6): one per GPU generation in gpus.toml
(volta fitted to the paper's runs, ampere and hopper from published kernel figures), a
calibrated file taking their place with --profile, the curves they carry, the errors a bad
one gets, and the plan saying which profile it used and how far that is off the published
runs of its generation."""

import json
import re
import statistics
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from click.testing import CliRunner

from megatrain.cli import main
from megatrain.plan import hardware
from megatrain.plan.costs import Costs
from megatrain.plan.published import check_rows_summary, load_runs, predict

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

MODELS = Path(__file__).resolve().parents[3] / "pipelines" / "models"
GPUS = hardware.load_gpus()
H100, A100, V100 = GPUS["h100-80gb"], GPUS["a100-80gb"], GPUS["v100-32gb"]


def test_every_gpu_names_a_profile_of_its_generation():
    profiles = hardware.builtin_profiles()
    assert set(profiles) == {"volta", "ampere", "hopper"}
    assert {k: g.profile for k, g in GPUS.items()} == {
        "v100-16gb": "volta",
        "v100-32gb": "volta",
        "a100-40gb": "ampere",
        "a100-80gb": "ampere",
        "h100-80gb": "hopper",
        "h100-96gb": "hopper",
        "h200-141gb": "hopper",
        "b200-180gb": "hopper",  # no Blackwell profile sourced: Hopper's, assumed
        "gb200-186gb": "hopper",  # the same
    }
    for name, profile in profiles.items():
        assert profile.name == name and not profile.measured and profile.source
    # volta is the fit the paper's tests hold (test_plan.py), at the data sheet's bandwidth
    volta = hardware.builtin_profile()
    assert volta == profiles["volta"]
    assert (volta.gemm_efficiency, volta.gemm_overhead_us, volta.elementwise_passes) == (
        0.8, 320, 4.8,
    )  # fmt: skip
    assert (volta.collective_efficiency, volta.collective_latency_us, volta.hbm_efficiency) == (
        0.8, 20, 1.0,
    )  # fmt: skip
    assert not volta.attention_tflops and not volta.gemm_efficiency_by_size
    # the published ones: FlashAttention-2's rates rise with the sequence; Hopper's above Ampere's
    for newer in ("ampere", "hopper"):
        rates = [t for _, t in profiles[newer].attention_tflops]
        assert rates == sorted(rates) and 0.5 < profiles[newer].gemm_efficiency < 1
    assert profiles["hopper"].attention_flops(8192) > profiles["ampere"].attention_flops(8192)


def test_curves_interpolate_in_log_size_and_stay_flat_beyond_their_ends():
    curve = ((512.0, 100.0), (2048.0, 200.0), (8192.0, 260.0))
    assert hardware.log_interpolate(curve, 1024) == pytest.approx(150.0)  # halfway in log s
    assert hardware.log_interpolate(curve, 4096) == pytest.approx(230.0)
    assert hardware.log_interpolate(curve, 2048) == 200.0
    assert hardware.log_interpolate(curve, 1) == 100.0
    assert hardware.log_interpolate(curve, 1e6) == 260.0
    profile = replace(hardware.builtin_profile("hopper"), attention_tflops=curve)
    assert profile.attention_flops(100) == 100e12 and profile.attention_flops(65536) == 260e12
    # GEMMs: the by-size fraction replaces the single efficiency, by the GEMM's own FLOPs
    by_size = replace(profile, gemm_efficiency_by_size=((1.0, 0.4), (100.0, 0.8)))
    assert by_size.gemm_fraction(10e9) == pytest.approx(0.6)
    assert by_size.gemm_fraction(1e6) == 0.4 and by_size.gemm_fraction(1e15) == 0.8
    costs = Costs(H100, by_size, "bf16")
    m = n = k = 1024  # 2.1 GFLOP: compute-bound
    fraction = by_size.gemm_fraction(2 * m * n * k)
    assert costs.gemm(m, n, k) == pytest.approx(
        2 * m * n * k / (989.4e12 * fraction) + by_size.gemm_overhead_s
    )
    flat = Costs(H100, profile, "bf16")  # no curve: the single efficiency
    assert flat.gemm(m, n, k) == pytest.approx(
        2 * m * n * k / (989.4e12 * profile.gemm_efficiency) + profile.gemm_overhead_s
    )
    # memory-bound terms at the profile's fraction of the data sheet's bandwidth
    assert flat.memory_bound(1e9) == pytest.approx(1e9 / (3350e9 * profile.hbm_efficiency))


def _gpus_toml_with(monkeypatch, old: str, new: str) -> None:
    text = (Path(hardware.__file__).parent / "gpus.toml").read_text()
    assert old in text
    changed = tomllib.loads(text.replace(old, new, 1))
    monkeypatch.setattr(hardware, "_builtin", lambda: changed)


BAD_TABLES = [  # (in gpus.toml, replaced by, the error names)
    ("gemm_efficiency = 0.803", "gemm_efficiency = 0",
     "hopper] gemm_efficiency must be a positive"),
    ("gemm_overhead_us = 20  #", "gemm_overhead_us = -1  #",
     "gemm_overhead_us must be a number >= 0"),
    ("[[512, 163], [1024, 221]", "[[1024, 163], [512, 221]",
     "attention_tflops: the sequence lengths must ascend"),
    ("[[512, 163], [1024, 221]", "[[512], [1024, 221]",
     "attention_tflops must be a list of [sequence length, TFLOP/s]"),
    ("collective_latency_us = 40", "collective_latency = 40", "misses collective_latency_us"),
    ("measured = false\n# ml-engineering's", "measured = 0\n# ml-engineering's",
     "hopper] measured must be true or false"),
    ('profile = "ampere"', 'profile = "turing"',
     "[gpu.a100-40gb] profile = 'turing' is not a profile"),
]  # fmt: skip


@pytest.mark.parametrize(("old", "new", "message"), BAD_TABLES)
def test_a_bad_profile_names_the_file_the_table_and_the_field(monkeypatch, old, new, message):
    _gpus_toml_with(monkeypatch, old, new)
    with pytest.raises(hardware.HardwareError, match=re.escape(message)) as error:
        hardware.load_gpus()
    assert str(error.value).startswith("gpus.toml: [")


def test_a_bad_profile_file_names_itself_and_the_field(tmp_path):
    good = {k: v for k, v in json.loads(_profile_json(tmp_path).read_text()).items()}
    for change, message in [
        ({"hbm_efficiency": "fast"}, "profile hbm_efficiency must be a positive number"),
        (
            {"gemm_efficiency_by_size": [[2.0, 0.5], [1.0, 0.6]]},
            "profile gemm_efficiency_by_size: the GFLOPs must ascend",
        ),
        ({"attention_efficiency": 0.4}, "profile has unknown attention_efficiency"),
        ({"source": ""}, "profile source must say where the numbers come from"),
    ]:
        path = tmp_path / "bad.json"
        path.write_text(json.dumps({**good, **change}))
        with pytest.raises(hardware.HardwareError, match=re.escape(f"{path}: {message}")):
            hardware.load_profile(path)


def test_a_gpu_file_entry_names_its_profile_or_keeps_the_replaced_ones(tmp_path):
    entry = (
        'name = "x"\nmemory_gib = 80\npeak_tflops = { bf16 = 900.0 }\nhbm_gbps = 3000\n'
        "intra_node_gbps = 450\ninter_node_gbps = 50\ngpus_per_node = 8\n"
    )
    path = tmp_path / "gpus.toml"
    path.write_text(f'[gpu.new]\n{entry}\n[gpu.h100-80gb]\n{entry}attention = "flash"\n')
    table = hardware.load_gpus(path)
    assert table["new"].profile == hardware.DEFAULT_PROFILE == "volta"  # a new GPU: the fit
    assert table["h100-80gb"].profile == "hopper"  # replacing an entry keeps its profile
    path.write_text(f'[gpu.new]\n{entry}profile = "ampere"\nattention = "flash"\n')
    assert hardware.load_gpus(path)["new"].profile == "ampere"


def _plan(*extra: str) -> dict:
    config = str(MODELS / "llama-tiny.toml")  # a small search, to keep it quick
    args = ["plan", "--config", config, "--gpus", "8", "--top", "1", "model.vocab_size=256",
            "training.precision=bf16", *extra]  # fmt: skip
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    return result.output


def test_the_h100_plan_uses_hopper_and_says_how_far_it_is_off_published_runs():
    text = _plan("--gpu", "h100-80gb")
    data = json.loads(_plan("--gpu", "h100-80gb", "--json"))
    profile = data["profile"]
    assert profile["name"] == "hopper" and profile["measured"] is False
    assert profile["attention_tflops"] == [
        list(p) for p in hardware.gpu_profile(H100).attention_tflops
    ]
    assert "time model: profile hopper (not measured: gpus.toml [profile.hopper]" in text
    # the check rows of Hopper GPUs, each predicted with the hopper profile
    runs = [r for r in load_runs() if r.use == "check" and GPUS[r.gpu].profile == "hopper"]
    errors = [abs(predict(r)[0] / r.value - 1) for r in runs]
    check = profile["published_check"]
    assert check["rows"] == len(runs) > 0 and check["generation"] == "hopper"
    assert check["within"] == sum(e <= 0.15 for e in errors)
    assert check["median_abs_error"] == pytest.approx(statistics.median(errors))
    line = (
        f"published runs: {check['within']} of {len(runs)} check rows on hopper GPUs "
        f"({', '.join(sorted({r.gpu for r in runs}))}) within 15% with this profile, median "
        "absolute error "
        f"{check['median_abs_error']:.0%}"
    )
    assert line in text
    # ... and names the rows beyond 15%, the worst first
    off = sorted(
        ((r.name, predict(r)[0] / r.value) for r, e in zip(runs, errors, strict=True) if e > 0.15),
        key=lambda item: -abs(item[1] - 1),
    )
    assert check["off"] == [{"run": n, "ratio": r} for n, r in off]
    assert len(off) == len(runs) - check["within"] > 0
    assert "; off (predicted / published): " + ", ".join(f"{n} {r:.2f}" for n, r in off) in text
    assert "308 at s" not in text and "at s 512-16384" in text  # llama-tiny's own s
    # an A100 plan: its own generation's profile and rows
    a100 = json.loads(_plan("--gpu", "a100-80gb", "--json"))["profile"]
    assert a100["name"] == "ampere" and a100["published_check"]["gpus"] == ["a100-80gb"]


def _profile_json(tmp_path: Path, device: hardware.Gpu | None = None) -> Path:
    """A measured profile as `--calibrate` writes one (without measuring: kept fast)."""
    profile = replace(
        hardware.builtin_profile("hopper"),
        gemm_efficiency_by_size=((0.01, 0.3), (10.0, 0.7)),
        attention_tflops=((512.0, 150.0), (4096.0, 300.0)),
        source="calibrated on a test machine (NVIDIA H100) 2026-01-01",
        measured=True,
        device=device,
    )
    path = tmp_path / "measured.json"
    hardware.save_profile(profile, path)
    return path


def test_a_calibrated_profile_file_is_used_and_named(tmp_path):
    path = _profile_json(tmp_path)
    loaded = hardware.load_profile(path)
    assert loaded.name == str(path) and loaded.measured
    assert loaded.attention_tflops == ((512.0, 150.0), (4096.0, 300.0))
    text = _plan("--gpu", "h100-80gb", "--profile", str(path))
    assert f"time model: profile {path} (measured: calibrated on a test machine" in text
    assert "fraction of peak 0.3-0.7 at GFLOP 0.01-10" in text
    data = json.loads(_plan("--gpu", "h100-80gb", "--profile", str(path), "--json"))
    assert data["profile"]["name"] == str(path) and data["profile"]["measured"] is True
    # the same published rows as hopper's, predicted with the measured profile instead
    check = data["profile"]["published_check"]
    assert check == check_rows_summary(H100, loaded)
    assert check != check_rows_summary(H100, hardware.gpu_profile(H100))
    # a CPU's calibrated profile plans for the CPU, with no published rows to compare
    cpu = hardware.Gpu("cpu", "a CPU", 64, {"fp32": 0.5}, 20, 5, 5, 2)
    cpu_path = _profile_json(tmp_path, device=cpu)
    config = str(MODELS / "gpt2-tiny.toml")
    result = CliRunner().invoke(
        main, ["plan", "--config", config, "model.vocab_size=1000", "--gpus", "1", "--top", "1",
               "--profile", str(cpu_path)],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert f"profile {cpu_path} (measured:" in result.output
    assert "published runs: no check rows on volta GPUs" in result.output


def test_flash_needs_a_profile_that_times_it(tmp_path):
    path = _profile_json(tmp_path)
    data = json.loads(path.read_text())
    data.pop("attention_tflops")
    path.write_text(json.dumps(data))
    config = str(MODELS / "llama-tiny.toml")
    args = ["plan", "--config", config, "--gpus", "8", "--gpu", "h100-80gb", "--profile",
            str(path), "model.vocab_size=256", "training.precision=bf16"]  # fmt: skip
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2 and f"profile {path} has none" in result.output
    result = CliRunner().invoke(main, [*args, "--attention", "unfused", "--top", "1"])
    assert result.exit_code == 0, result.output
    # it cannot time the published rows on flash GPUs either: left out, and said
    flash = [r for r in load_runs() if r.use == "check" and GPUS[r.gpu].profile == "hopper"]
    line = f"published runs: no check rows on hopper GPUs it can time ({len(flash)} need flash)"
    assert line in result.output
