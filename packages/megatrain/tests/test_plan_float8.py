"""`megatrain plan` for training.precision = "fp8" (issue 50 item 5: every dimension the
suite trains with is in the search with its costs): the layers' linears in float8 at the fp8
peak, torchao's casts as they run (eager or compiled), everything else in bf16; refused with
the field named on a GPU or profile that cannot time it."""

import json
import re
from dataclasses import replace
from pathlib import Path

import pytest
from click.testing import CliRunner

from megatrain.cli import main
from megatrain.config import load_config
from megatrain.models import model_config
from megatrain.plan import hardware
from megatrain.plan.accounting import float8_gemm, layer_gemms
from megatrain.plan.cost_model import estimate, layer_seconds
from megatrain.plan.costs import Costs
from megatrain.plan.layout import Layout, apply_layout
from megatrain.plan.search import plan

MODELS = Path(__file__).resolve().parents[3] / "pipelines" / "models"
GPUS = hardware.load_gpus()
H100, A100 = GPUS["h100-80gb"], GPUS["a100-80gb"]
HOPPER = hardware.gpu_profile(H100)
VOCAB = 128256


def _llama(precision: str, compile_: bool = False):
    config = load_config(MODELS / "llama3-8b.toml")
    t = replace(config.training, precision=precision, compile=compile_)
    return replace(config, training=t)


def test_float8_linear_times_by_hand():
    """A [m, k] x [k, n] linear: three GEMMs at 70.9% of 1978.9 TFLOP/s (operands 1 byte, the
    output 2), plus the casts' bytes at the memory-bound rate: compiled, torchao's roofline
    (X 6 and W 5 bytes an element in the forward; G 6 and W 3 in the backward); eager, the
    six casts as torch ops (33 bytes each) and three layout copies (2 each)."""
    m, n, k = 16384.0, 6144.0, 4096.0
    hbm = 3350e9 * HOPPER.hbm_efficiency
    rate = 1978.9e12 * 0.709
    tau = HOPPER.gemm_overhead_us * 1e-6

    def gemm(a, b, c):  # [a, c] x [c, b] in float8
        return max(2 * a * b * c / rate, (a * c + c * b + 2 * a * b) / hbm) + tau

    x, w, g = m * k, k * n, m * n
    compiled = Costs(H100, HOPPER, "fp8", compiled=True)
    forward, backward = compiled.linear_fwd_bwd(m, n, k, float8=True)
    assert forward == pytest.approx(gemm(m, n, k) + (6 * x + 5 * w) / hbm)
    assert backward == pytest.approx(gemm(m, k, n) + gemm(k, n, m) + (6 * g + 3 * w) / hbm)

    eager = Costs(H100, HOPPER, "fp8")
    forward, backward = eager.linear_fwd_bwd(m, n, k, float8=True)
    assert forward == pytest.approx(gemm(m, n, k) + 33 * (x + w) / hbm)
    casts = (33 + 35) * g + 35 * w + 35 * x  # G twice (one copy), W once more, X once more
    assert backward == pytest.approx(gemm(m, k, n) + gemm(k, n, m) + casts / hbm)
    # a linear that stays bf16 (or a bf16 run) is the bf16 GEMMs at the bf16 peak
    bf16 = Costs(H100, HOPPER, "bf16")
    assert eager.linear_fwd_bwd(m, n, k, float8=False) == bf16.gemm_fwd_bwd(m, n, k)
    assert bf16.linear_fwd_bwd(m, n, k, float8=True) == bf16.gemm_fwd_bwd(m, n, k)
    assert eager.peak == bf16.peak == 989.4e12
    # large GEMMs compiled: faster than bf16 by about the MAMF ratio, less the casts
    bf16_total = sum(bf16.gemm_fwd_bwd(m, n, k))
    fp8_total = sum(compiled.linear_fwd_bwd(m, n, k, float8=True))
    assert 1.3 < bf16_total / fp8_total < 1979 * 0.709 / (989.4 * 0.803)
    assert sum(eager.linear_fwd_bwd(m, n, k, float8=True)) > bf16_total  # why compile matters


def test_which_gemms_megatrain_runs_in_float8():
    """parallelize.apply_float8's: the layers' column- and row-parallel linears whose weight
    shard has both dimensions multiples of 16; not ReplicatedKV, the router or the experts."""
    llama = model_config(load_config(MODELS / "llama3-8b.toml"), VOCAB)
    gemms = {g.name: g for g in layer_gemms(llama)}
    assert all(float8_gemm(g, 8) for g in gemms.values())  # 8 groups over 8 ranks
    # 16 ranks > 8 groups: ReplicatedKV, a plain module apply_float8 does not convert
    assert [n for n, g in gemms.items() if not float8_gemm(g, 16)] == ["kv"]
    # a shard not a multiple of 16: fc1's 14336 / 64 = 224 is, 14336 / 128 = 112 is, / 7 not
    assert float8_gemm(gemms["fc1"], 128)
    odd = replace(llama, ffn_hidden_size=14336 + 8)
    assert not float8_gemm({g.name: g for g in layer_gemms(odd)}["fc1"], 1)
    mixtral = model_config(load_config(MODELS / "mixtral-8x7b.toml"), 32000)
    routed = [g.name for g in layer_gemms(mixtral, moe=True) if not float8_gemm(g, 1)]
    assert routed == ["router", "experts.weight1", "experts.weight2"]


def test_fp8_layer_and_estimate_use_float8_only_for_the_linears():
    """The layer's compute under fp8 is bf16's less its linears' bf16 times plus their float8
    ones (the flash attention core and the element-wise ops unchanged); the MFU is of the bf16
    peak, as megatrain run reports it."""
    layout = Layout(tp=2, pp=1, dp=4, micro_batch=1, sequence_parallel=True)
    cfg = model_config(_llama("bf16"), VOCAB)
    tokens = 8192
    parts = {}
    for precision, compiled in (("bf16", False), ("fp8", False), ("fp8", True)):
        config = apply_layout(_llama(precision, compiled), layout, 512)
        costs = Costs(H100, HOPPER, precision, compiled)
        layer = layer_seconds(config, layout, costs, 450e9, cfg=cfg)
        linears = [
            sum(costs.linear_fwd_bwd(tokens, *g.per_rank(2)[::-1], float8_gemm(g, 2)))
            for g in layer_gemms(cfg)
        ]
        parts[precision, compiled] = (layer["compute"] - sum(linears), layer)
        result = estimate(_llama(precision, compiled), layout, H100, HOPPER, VOCAB, 512)
        model_flops = result.mfu * result.time["total"] * 8 * 989.4e12
        if precision == "bf16":
            flops = model_flops
        assert model_flops == pytest.approx(flops)
    rest = {key: value[0] for key, value in parts.items()}
    assert rest["fp8", False] == pytest.approx(rest["bf16", False])
    assert rest["fp8", True] == pytest.approx(rest["bf16", False])
    compute = {key: value[1]["compute"] for key, value in parts.items()}
    assert compute["fp8", True] < compute["bf16", False] < compute["fp8", False]
    # the TP collectives are the same bytes (bf16 activations)
    assert len({value[1]["tp_comm"] for value in parts.values()}) == 1


def test_fp8_refused_where_it_cannot_be_timed(tmp_path):
    """No fp8 peak (an A100) or no fp8_gemm_efficiency in the profile: refused before the
    search, naming what is missing."""
    config = _llama("fp8", True)
    with pytest.raises(ValueError, match=r"a100-80gb has no fp8 peak .* need Hopper or newer"):
        plan(config, 8, A100, hardware.gpu_profile(A100), VOCAB)
    volta = hardware.builtin_profile("volta")
    with pytest.raises(ValueError, match="profile volta has no fp8_gemm_efficiency"):
        plan(config, 8, H100, volta, VOCAB)
    # a profile file carries it (a calibrated one has none until a user adds it)
    path = tmp_path / "profile.json"
    hardware.save_profile(replace(HOPPER, fp8_gemm_efficiency=None, measured=True), path)
    assert hardware.load_profile(path).fp8_gemm_efficiency is None
    data = json.loads(path.read_text())
    path.write_text(json.dumps({**data, "fp8_gemm_efficiency": 0.65}))
    assert hardware.load_profile(path).fp8_gemm_efficiency == 0.65
    path.write_text(json.dumps({**data, "fp8_gemm_efficiency": 0}))
    with pytest.raises(hardware.HardwareError, match="fp8_gemm_efficiency must be a positive"):
        hardware.load_profile(path)


def test_cli_plans_fp8_and_says_how():
    config = str(MODELS / "llama-tiny.toml")
    args = ["plan", "--config", config, "--gpus", "8", "--gpu", "h100-80gb", "--top", "1",
            "model.vocab_size=256", "training.precision=fp8"]  # fmt: skip
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert "fp8: the layers' linears in float8 at 71% of the fp8 peak (1979 TFLOP/s)" in (
        result.output
    )
    assert "eager, as torchao's ops run" in result.output
    # eager: what #1 would take compiled, said in the text and the JSON
    data = json.loads(CliRunner().invoke(main, [*args, "--json"]).output)
    first, compiled = data["layouts"][0], data["first_compiled"]
    assert compiled["layout"] == first["layout"]
    assert compiled["time_s"]["total"] < first["time_s"]["total"]
    line = f"with training.compile=true it would take {compiled['time_s']['total']:.3f} s a step"
    assert line in result.output
    result = CliRunner().invoke(main, [*args, "training.compile=true", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["profile"]["fp8_gemm_efficiency"] == 0.709 and data["first_compiled"] is None
    # the compiled plan's #1 is at most the eager #1 compiled
    assert data["layouts"][0]["time_s"]["total"] <= compiled["time_s"]["total"]
    a100 = [("a100-80gb" if a == "h100-80gb" else a) for a in args]
    result = CliRunner().invoke(main, a100)
    assert result.exit_code == 2
    assert re.search(r"a100-80gb has no fp8 peak .* plan it in bf16", result.output)
