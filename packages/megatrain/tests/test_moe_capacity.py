"""Capacity drops decided over the whole sequence (model.moe_expert_capacity_factor): a
mixture-of-experts Llama whose experts drop choices takes one process's steps at tp 2 with
sequence parallelism, at cp 2, at tp 2 x cp 2 and at ep 2 x tp 2 (expert tensor parallel 2),
under both drop policies ("probs": the lowest weights go; "position": the latest tokens).

One 1-rank spawn trains the two references; one 4-rank spawn trains the layouts and, as the
negative control, tp 2 x cp 2 with each rank deciding over its own tokens (Megatron's way,
the router's `token_layout` cleared), which must leave one process's steps: the test could
not pass with the layout-wide decision switched off.  Losses, gradient norms, validation
loss, the logged load-balancing loss and each layer's logged dropped fraction are compared."""

import json
from pathlib import Path

import pytest
from test_expert_parallel import FP32_TOL, TP2_SP, VOCAB, _config
from test_expert_parallel import _trained as _trained_with_aux

from megacore.testing import run_distributed
from megatrain import parallelize
from megatrain.models import moe
from megatrain.testing import assert_same_steps, write_counting_corpus

# test_expert_parallel's MoE Llama (2 layers, 4 experts, top-2, the aux and z losses) and its
# "capacity" routing: moe_expert_capacity_factor 1.0.
POLICIES = ("probs", "position")
CP2 = ["parallel.context_parallel_size=2"]
# 4 ranks each, data parallelism filling the rest.
LAYOUTS = {
    "tp2-sp": TP2_SP,
    "cp2": CP2,
    "tp2-sp-cp2": [*TP2_SP, *CP2],
    "ep2-tp2-sp": [*TP2_SP, "parallel.expert_model_parallel_size=2"],
}
CONTROL = "tp2-sp-cp2"  # trained again with each rank deciding its own drops


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return str(write_counting_corpus(tmp_path_factory.mktemp("corpus"), VOCAB))


def _trained(corpus, out, policy, overrides=()) -> dict | None:
    """`train`'s history with each step's logged dropped fractions (rank 0)."""
    policy = [f"model.moe_token_drop_policy={policy!r}"]
    run = _trained_with_aux(_config(corpus, out, "capacity", [*policy, *overrides]))
    if run is not None:
        log = Path(out) / "log.jsonl"
        run["dropped"] = [json.loads(line)["moe_dropped"] for line in log.read_text().splitlines()]
    return run


def _references(corpus, out):
    return {p: _trained(corpus, f"{out}/{p}", p) for p in POLICIES}


def _per_rank_decisions(chunk) -> None:
    """`apply_expert_parallel`, then each router deciding over its own rank's tokens."""
    _apply_expert_parallel(chunk)
    for layer in moe.moe_layers([chunk]):
        layer.router.token_layout = None


_apply_expert_parallel = parallelize.apply_expert_parallel


def _layouts(corpus, out):
    runs = {
        (name, p): _trained(corpus, f"{out}/{name}-{p}", p, o)
        for name, o in LAYOUTS.items()
        for p in POLICIES
    }
    parallelize.apply_expert_parallel = _per_rank_decisions
    try:
        for p in POLICIES:
            runs["control", p] = _trained(corpus, f"{out}/control-{p}", p, LAYOUTS[CONTROL])
    finally:
        parallelize.apply_expert_parallel = _apply_expert_parallel
    return runs


@pytest.fixture(scope="module")
def references(corpus, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("capacity-one"))
    return run_distributed(_references, 1, args=(corpus, out), timeout=300)[0]


@pytest.fixture(scope="module")
def layouts(corpus, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("capacity-layouts"))
    return run_distributed(_layouts, 4, args=(corpus, out), timeout=500)[0]


def _same_drops(run, reference, name):
    for a, b in zip(run["dropped"], reference["dropped"], strict=True):
        assert a.keys() == b.keys(), name
        for layer in a:
            assert abs(a[layer] - b[layer]) < 1e-9, (name, run["dropped"], reference["dropped"])


def test_capacity_drops_are_one_processes_at_every_layout(references, layouts):
    for p in POLICIES:
        # The case is there: every layer drops choices at every step.
        assert all(v > 0 for step in references[p]["dropped"] for v in step.values()), p
    # The policies drop different choices: each reference is its own.
    assert references["probs"]["loss"] != references["position"]["loss"]
    for name in LAYOUTS:
        for p in POLICIES:
            run, reference = layouts[name, p], references[p]
            assert_same_steps(run, reference, f"{name} {p}", FP32_TOL)
            for a, b in zip(run["aux"], reference["aux"], strict=True):
                assert abs(a - b) < FP32_TOL, (name, p, run["aux"], reference["aux"])
            _same_drops(run, reference, f"{name} {p}")


def test_per_rank_capacity_decisions_leave_one_processes_steps(references, layouts):
    # The negative control: each rank's capacity from its own s / (tp x cp) tokens drops
    # other choices, and the steps are no longer one process's.
    for p in POLICIES:
        run, reference = layouts["control", p], references[p]
        worst = max(abs(a - b) for a, b in zip(run["loss"], reference["loss"], strict=True))
        assert worst > 100 * FP32_TOL, (p, run["loss"], reference["loss"])
