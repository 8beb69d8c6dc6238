"""Pipeline parallelism equals one process: 1F1B, interleaved and tp x pp on real gloo groups."""

import weakref

import pytest
import torch
from tiny_transformer import TinyConfig, TinyGPT, full_tensor

from megacore import parallel_state as ps
from megacore import pipeline_parallel as pipe
from megacore import tensor_parallel as tp
from megacore.pipeline_parallel import Step
from megacore.testing import run_distributed

SEQ, MICRO_BATCH, STEPS, LR = 8, 2, 3, 0.2


def _microbatches(cfg, count, step):
    g = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, cfg.vocab_size, (count, MICRO_BATCH, SEQ + 1), generator=g)
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


class _Recorder:
    """Order of forward/backward steps, and peak number of microbatches with live activations."""

    def __init__(self):
        self.order, self.live, self.peak = [], {}, 0
        self.forwards = {}

    def _packed(self, key):
        self.live[key] = self.live.get(key, 0) + 1
        self.peak = max(self.peak, len(self.live))
        token = object.__new__(_Token)
        weakref.finalize(token, self._released, key)
        return token

    def _released(self, key):
        self.live[key] -= 1
        if not self.live[key]:
            del self.live[key]

    def forward_step(self, data_iterator, model):
        chunk = ps.get_virtual_pipeline_model_parallel_rank() or 0
        microbatch = self.forwards.get(chunk, 0)
        self.forwards[chunk] = microbatch + 1
        key = (microbatch, chunk)
        tokens, targets = next(data_iterator)
        with torch.autograd.graph.saved_tensors_hooks(
            lambda t: (self._packed(key), t), lambda packed: packed[1]
        ):
            out = model(tokens, targets)
        self.order.append(Step("F", microbatch, chunk))
        if out.requires_grad:
            out.register_hook(lambda g: self.order.append(Step("B", microbatch, chunk)))
        return out, lambda loss: (loss, {"loss": loss.detach()})


class _Token:
    pass


def _build_chunks(cfg, pp, vpp):
    chunks = []
    for v in range(vpp or 1):
        layer_ids = pipe.layers_for(
            cfg.layers, ps.get_pipeline_model_parallel_rank(), pp, vpp, virtual_rank=v
        )
        if vpp:
            ps.set_virtual_pipeline_model_parallel_rank(v)
        chunks.append(
            TinyGPT(
                cfg,
                layer_ids,
                pre_process=ps.is_pipeline_first_stage(),
                post_process=ps.is_pipeline_last_stage(),
            )
        )
    if vpp:
        ps.set_virtual_pipeline_model_parallel_rank(0)
    pipe.sync_shared_embeddings(chunks)
    return chunks


def _train(cfg, tp_size, pp, vpp, num_microbatches):
    """Train STEPS steps; return per-step losses (last stage), full weights, recorder."""
    ps.initialize_model_parallel(tp_size, pp, vpp)
    tp.model_parallel_manual_seed(0)
    chunks = _build_chunks(cfg, pp, vpp)
    params = [p for c in chunks for p in c.parameters()]
    optimizer = torch.optim.SGD(params, lr=LR)
    forward_backward = pipe.get_forward_backward_func()
    losses, recorder = [], None
    for step in range(STEPS):
        recorder = _Recorder()
        data = _microbatches(cfg, num_microbatches, step)
        optimizer.zero_grad(set_to_none=True)
        infos = forward_backward(
            forward_step_func=recorder.forward_step,
            data_iterator=[iter(data) for _ in chunks] if vpp else iter(data),
            model=chunks if vpp else chunks[0],
            num_microbatches=num_microbatches,
            seq_length=SEQ,
            micro_batch_size=MICRO_BATCH,
            hidden_size=cfg.hidden,
            finalize_model_grads_func=pipe.finalize_model_grads,
        )
        optimizer.step()
        if infos:
            losses.append(sum(i["loss"] for i in infos).item() / num_microbatches)
    weights = {}
    for c in chunks:
        for name, p in c.named_parameters():
            weights[name] = full_tensor(p)
    out = {
        "losses": losses,
        "weights": weights,
        "order": recorder.order,
        "peak_live": recorder.peak,
        "pp_rank": ps.get_pipeline_model_parallel_rank(),
    }
    ps.destroy_model_parallel()
    return out


LAYOUTS = {
    # name: (tp, pp, vpp, microbatches)
    "pp2": (1, 2, None, 4),
    "pp4": (1, 4, None, 8),
    "pp2_vpp2": (1, 2, 2, 4),
    "tp2_pp2": (2, 2, None, 6),
}


def _pipelines_against_one_process():
    cfg = TinyConfig(layers=8)
    out = {}
    for name, (tp_size, pp, vpp, m) in LAYOUTS.items():
        reference = _train(
            cfg, 1, 1, None, m
        )  # one process accumulating over the same microbatches
        got = _train(cfg, tp_size, pp, vpp, m)
        ref_w = reference["weights"]
        diffs = {}
        for pname, w in got["weights"].items():
            # The last stage's copy of the tied embedding is the reference's embedding.
            ref_name = "embedding.weight" if pname == "output_weight" else pname
            diffs[pname] = (w - ref_w[ref_name]).abs().max().item()
        out[name] = {
            "losses": got["losses"],
            "ref_losses": reference["losses"],
            "max_weight_diff": max(diffs.values()),
            "names": sorted(got["weights"]),
            "order": got["order"],
            "peak_live": got["peak_live"],
            "pp_rank": got["pp_rank"],
        }
    return out


def test_pipeline_layouts_equal_one_process():
    results = run_distributed(_pipelines_against_one_process, world_size=4, timeout=400)
    for rank, out in enumerate(results):
        for name, (_, pp, _, _) in LAYOUTS.items():
            r = out[name]
            where = f"rank {rank}, layout {name}"
            last_stage = r["pp_rank"] == pp - 1
            if last_stage:
                assert len(r["losses"]) == STEPS, where
                assert r["losses"] == pytest.approx(r["ref_losses"], abs=1e-5), where
                assert r["ref_losses"][-1] < r["ref_losses"][0], where  # it trained
            else:
                assert r["losses"] == [], where
            assert r["max_weight_diff"] < 1e-5, where
            # Only whole layers, and the tied copy on the last stage.
            if pp > 1 and last_stage:
                assert "output_weight" in r["names"], where
        # 1F1B with 8 microbatches over 4 stages: rank r keeps pp - r microbatches alive.
        pp4 = out["pp4"]
        assert pp4["peak_live"] == 4 - pp4["pp_rank"], rank
        assert out["pp2"]["peak_live"] == 2 - out["pp2"]["pp_rank"], rank
        # The interleaved run executed the expected (microbatch, chunk) order.
        vp = out["pp2_vpp2"]
        assert " ".join(map(repr, vp["order"])) == INTERLEAVED_ORDER[vp["pp_rank"]], rank


# pp=2, vpp=2, 4 microbatches, derived by hand from the interleaved rule (Fm.c = forward of
# microbatch m on chunk c; chunk 0 is omitted).
INTERLEAVED_ORDER = {
    0: "F0 F1 F0.1 F1.1 F2 B0.1 F3 B1.1 F2.1 B0 F3.1 B1 B2.1 B3.1 B2 B3",
    1: "F0 F1 F0.1 B0.1 F1.1 B1.1 F2 B0 F3 B1 F2.1 B2.1 F3.1 B3.1 B2 B3",
}


def test_interleaved_table_and_refusals():
    for rank, expected in INTERLEAVED_ORDER.items():
        table = pipe.schedule_interleaved(4, 2, rank, 2)
        assert " ".join(map(repr, table)) == expected
    # 1F1B: warm-up of pp - rank - 1 forwards.
    assert " ".join(map(repr, pipe.schedule_1f1b(4, 4, 1))) == "F0 F1 F2 B0 F3 B1 B2 B3"
    assert " ".join(map(repr, pipe.schedule_1f1b(2, 4, 0))) == "F0 F1 B0 B1"
    with pytest.raises(
        ValueError, match=r"num_microbatches \(6\) to be a multiple of .* \(4\); use 8"
    ):
        pipe.schedule_interleaved(6, 4, 0, 2)


def test_layer_assignment():
    # Seed 003: 16 layers, pp 4, vpp 2: rank 0 holds layers 1-2 and 9-10 (from one).
    table = [[pipe.layers_for(16, r, 4, 2, c) for c in range(2)] for r in range(4)]
    assert table[0] == [[0, 1], [8, 9]]
    assert table == [[[2 * r, 2 * r + 1], [8 + 2 * r, 9 + 2 * r]] for r in range(4)]
    assert [pipe.layers_for(12, r, 3) for r in range(3)] == [
        [0, 1, 2, 3],
        [4, 5, 6, 7],
        [8, 9, 10, 11],
    ]
    with pytest.raises(ValueError, match=r"num_layers \(10\) is not divisible by .* \(4 x 1 = 4\)"):
        pipe.layers_for(10, 0, 4)
    with pytest.raises(ValueError, match=r"\(4 x 2 = 8\)"):
        pipe.layers_for(12, 0, 4, 2)
    # Uneven splits when the user sets the first/last stage counts.
    assert [pipe.layers_for(10, r, 4, None, 0, 1, 3) for r in range(4)] == [
        [0], [1, 2, 3], [4, 5, 6], [7, 8, 9],
    ]  # fmt: skip
    assert pipe.stage_layer_counts(14, 4, 2, num_layers_in_last_pipeline_stage=2) == [4, 4, 4, 2]
    with pytest.raises(ValueError, match="stage 0 would get 3 layers"):
        pipe.stage_layer_counts(9, 2, 2, num_layers_in_first_pipeline_stage=3)
    with pytest.raises(ValueError, match="cannot be split evenly over the other 2"):
        pipe.stage_layer_counts(10, 4, None, 1, 2)
