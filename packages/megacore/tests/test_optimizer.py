"""Optimizer pieces: dynamic loss scaling (Megatron's rule, step by step), Adam parameter groups."""

import pytest
import torch

from megacore.optimizer import ConstantGradScaler, DynamicGradScaler


def test_defaults_are_the_papers():
    s = DynamicGradScaler()
    assert (s.scale, s.min_scale, s.growth_factor, s.backoff_factor) == (2.0**32, 1.0, 2.0, 0.5)
    assert (s.growth_interval, s.hysteresis) == (1000, 2)


def test_hysteresis_then_backoff_and_floor():
    s = DynamicGradScaler(initial_scale=8.0, min_scale=2.0, hysteresis=2, growth_interval=3)
    s.update(found_inf=True)
    assert s.scale == 8.0  # first overflow spends the hysteresis only
    s.update(found_inf=True)
    assert s.scale == 4.0
    s.update(found_inf=True)  # hysteresis stays spent until a growth refills it
    assert s.scale == 2.0
    s.update(found_inf=True)
    assert s.scale == 2.0  # never below min_scale


def test_growth_after_clean_interval_resets_on_overflow():
    s = DynamicGradScaler(initial_scale=4.0, growth_interval=3, hysteresis=1)
    for _ in range(2):
        s.update(found_inf=False)
    s.update(found_inf=True)  # resets the clean-step count and backs off
    assert s.scale == 2.0
    for _ in range(2):
        s.update(found_inf=False)
    assert s.scale == 2.0
    s.update(found_inf=False)
    assert s.scale == 4.0


def test_growth_refills_hysteresis():
    s = DynamicGradScaler(initial_scale=16.0, growth_interval=2, hysteresis=2)
    s.update(found_inf=True)
    s.update(found_inf=False)
    s.update(found_inf=False)
    assert (s.scale, s.hysteresis_tracker) == (32.0, 2)
    s.update(found_inf=True)
    assert s.scale == 32.0


def test_state_round_trip_and_constant():
    s = DynamicGradScaler(initial_scale=64.0, growth_interval=5)
    s.update(found_inf=True)
    s.update(found_inf=False)
    t = DynamicGradScaler(initial_scale=64.0, growth_interval=5)
    t.load_state_dict(s.state_dict())
    assert (t.scale, t.growth_tracker, t.hysteresis_tracker) == (64.0, 1, 1)
    c = ConstantGradScaler(128.0)
    c.update(found_inf=True)
    assert c.scale == 128.0 and c.state_dict() == {"scale": 128.0}


def test_bad_settings_named():
    with pytest.raises(ValueError, match=r"min_scale \(4.0\) <= initial_scale \(2.0\)"):
        DynamicGradScaler(initial_scale=2.0, min_scale=4.0)
    with pytest.raises(ValueError, match="backoff_factor"):
        DynamicGradScaler(backoff_factor=1.5)
    with pytest.raises(ValueError, match="loss scale must be > 0"):
        ConstantGradScaler(0.0)


def test_no_weight_decay_on_biases_and_norms():
    from torch import nn

    from megacore.optimizer import adamw, get_param_groups

    model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 2, bias=False))
    decay, no_decay = get_param_groups([model, model])  # a chunk listed twice counts once
    assert decay["weight_decay"] == 0.01 and no_decay["weight_decay"] == 0.0
    assert [p.shape for p in decay["params"]] == [(8, 4), (2, 8)]
    assert [p.shape for p in no_decay["params"]] == [(8,), (8,), (8,)]
    opt = adamw([model], lr=1e-3)
    # Decoupled decay: a zero gradient still shrinks matrices, and leaves biases alone.
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    before = [p.detach().clone() for p in model.parameters()]
    opt.step()
    after = list(model.parameters())
    assert torch.allclose(after[0], before[0] * (1 - 1e-3 * 0.01))
    assert torch.equal(after[1], before[1])  # bias
