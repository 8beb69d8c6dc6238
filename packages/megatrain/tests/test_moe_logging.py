"""The experts' load in the run's log (issue 45 item 8): tokens per expert per MoE layer as
max/mean and the dropped fraction in log.jsonl, and one line when a router collapses."""

import json
from pathlib import Path

import torch

from megatrain.config import load_config
from megatrain.models.moe import moe_layers
from megatrain.run import loop
from megatrain.run.expert_load import ExpertLoad
from megatrain.testing import world_of_one, write_counting_corpus

MODELS = Path(__file__).resolve().parents[3] / "pipelines" / "models"


def test_expert_load_logged_and_a_collapsed_router_named(tmp_path, monkeypatch, capsys):
    """mixtral-tiny (2 MoE layers here) with a sigmoid router and a capacity factor of 1:
    layer 0's expert bias set huge for expert 0 (it chooses, never weighs), so every token
    takes expert 0, which drops 3/4 of them, and the line names layer 0, once per log
    interval; layer 1 is left as built."""
    built = loop.build_run

    def collapsed(config, device):
        run = built(config, device)
        with torch.no_grad():
            moe_layers(run.chunks)[0].router.expert_bias[0] = 1e4
        return run

    monkeypatch.setattr(loop, "build_run", collapsed)
    corpus = write_counting_corpus(tmp_path / "corpus", 200)
    out = tmp_path / "run"
    overrides = [
        "model.num_layers=2", "model.hidden_size=64", "model.ffn_hidden_size=64",
        "model.max_position_embeddings=64", "training.seq_length=32",
        "training.micro_batch_size=4", "training.global_batch_size=8",
        "training.train_iters=2", "optimizer.lr_warmup_iters=1", "training.eval_iters=1",
        "logging.log_interval=1", "logging.tensorboard=false", "logging.peak_tflops=1.0",
        "data.verify_sha256=false", f"data.corpus={str(corpus)!r}",
        f"training.output_dir={str(out)!r}", 'model.moe_router_score_function="sigmoid"',
        "model.moe_router_enable_expert_bias=true", "model.moe_expert_capacity_factor=1.0",
    ]  # fmt: skip
    config = load_config(MODELS / "mixtral-tiny.toml", overrides)
    with world_of_one(tmp_path / "rendezvous"):
        loop.train(config)
    records = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    records = [r for r in records if "loss" in r]
    assert len(records) == 2
    for r in records:
        assert set(r["moe_load"]) == set(r["moe_dropped"]) == {"layer0", "layer1"}
        # Every token of layer 0 chooses expert 0, 4 times its share (E / k), which keeps its
        # capacity (its share) and drops the rest: 3/8 of the choices.
        assert r["moe_dropped"]["layer0"] == 3 / 8
        assert 1.0 <= r["moe_load"]["layer1"] < 3.0
        assert 0.0 <= r["moe_dropped"]["layer1"] < 0.25
        assert r["moe_aux_loss"] > 0
    lines = [x for x in capsys.readouterr().out.splitlines() if "router collapse" in x]
    assert len(lines) == 2
    assert all("layer0 max/mean" in x and "37.5% dropped" in x for x in lines)
    assert not any("layer1" in x for x in lines)


def test_collapse_named_without_capacity():
    """Dropless: max/mean 4 (every token on expert 0 and one other: E / k) or under half the
    experts used names the layer; a balanced one is not named."""
    load = ExpertLoad([], 3, 8, "cpu")
    t = 64  # tokens, 2 choices each
    load.totals[0, :8] = torch.tensor([t, t // 7 + 1, *[t // 7] * 6])  # expert 0 always
    load.totals[1, :8] = torch.tensor([t // 4] * 8)  # balanced
    load.totals[2, :8] = torch.tensor([t // 2] * 3 + [t // 2 - 1] + [0] * 4)  # 4 of 8 used
    load.totals[2, :3] += 1
    for i in range(3):
        load.totals[i, -1] = load.totals[i, :8].sum()
    fields = load.fields(capacity=False)
    assert "moe_dropped" not in fields
    assert fields["moe_load"]["layer0"] == t / (2 * t / 8)
    assert fields["moe_load"]["layer1"] == 1.0
    line = load.collapse_line(fields, 10)
    assert "layer0 max/mean 4.00, 8 of 8 experts" in line and "layer1" not in line
    assert "layer2" not in line  # half the experts used is not under half
    # Counted from zero at each log iteration: now 3 of 8 experts used.
    load.totals[2, :8] = torch.tensor([t // 2] * 3 + [0] * 5)
    load.totals[2, -1] = 3 * (t // 2)
    fields = load.fields(capacity=False)
    assert set(fields["moe_load"]) == {"layer2"}
    assert "layer2 max/mean 2.67, 3 of 8 experts" in load.collapse_line(fields, 20)
