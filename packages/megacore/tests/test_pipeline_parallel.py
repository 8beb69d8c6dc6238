"""Pipeline parallelism equals one process: 1F1B, interleaved and tp x pp on real gloo groups."""

import types
import weakref

import pytest
import torch
import torch.distributed as dist
from tiny_stack import TinyConfig, TinyStack, build_chunks, full_tensor
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

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
        token = _Token()  # its finalizer marks the saved tensor freed
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


def _schedule(recorder, data_iterator, model, num_microbatches, schedule=None, **kwargs):
    """The layout's schedule over the test's microbatch shape."""
    return pipe.get_forward_backward_func(schedule)(
        forward_step_func=recorder.forward_step,
        data_iterator=data_iterator,
        model=model,
        num_microbatches=num_microbatches,
        seq_length=SEQ,
        micro_batch_size=MICRO_BATCH,
        **kwargs,
    )


def _train(cfg, tp_size, pp, vpp, num_microbatches, schedule=None):
    """Train STEPS steps; return per-step losses (last stage), full weights, recorder."""
    ps.initialize_model_parallel(tp_size, pp, vpp)
    tp.model_parallel_manual_seed(0)
    chunks = build_chunks(cfg, pp, vpp)
    params = [p for c in chunks for p in c.parameters()]
    optimizer = torch.optim.SGD(params, lr=LR)
    losses, recorder = [], None
    for step in range(STEPS):
        recorder = _Recorder()
        data = _microbatches(cfg, num_microbatches, step)
        optimizer.zero_grad(set_to_none=True)
        infos = _schedule(
            recorder,
            [iter(data) for _ in chunks] if vpp else iter(data),
            chunks if vpp else chunks[0],
            num_microbatches,
            schedule,
            hidden_size=cfg.hidden,
            finalize_model_grads_func=pipe.finalize_model_grads,
        )
        optimizer.step()
        if infos:
            losses.append(sum(i["loss"] for i in infos).item() / num_microbatches)
    tied_equal = None
    shared = [p for c in chunks for p in c.parameters() if getattr(p, "shared_embedding", False)]
    if shared:  # first and last stage: their two copies must be bit-identical
        copies = [torch.empty_like(shared[0]) for _ in range(2)]
        dist.all_gather(copies, shared[0].detach(), group=ps.get_embedding_group())
        tied_equal = torch.equal(copies[0], copies[1])
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
        "tied_equal": tied_equal,
    }
    ps.destroy_model_parallel()
    return out


LAYOUTS = {
    # name: (tp, pp, vpp, microbatches, schedule)
    "pp2": (1, 2, None, 4, None),
    "pp4": (1, 4, None, 8, None),
    "pp2_vpp2": (1, 2, 2, 4, None),
    "tp2_pp2": (2, 2, None, 6, None),
    "pp4_vpp2": (1, 4, 2, 8, None),
    "pp2_zb": (1, 2, None, 5, "zb-h1"),
    "pp4_zb": (1, 4, None, 8, "zb-h1"),
    "tp2_pp2_zb": (2, 2, None, 6, "zb-h1"),
}


def _pipelines_against_one_process():
    cfg = TinyConfig(layers=8)
    out = {}
    for name, (tp_size, pp, vpp, m, schedule) in LAYOUTS.items():
        reference = _train(
            cfg, 1, 1, None, m
        )  # one process accumulating over the same microbatches
        got = _train(cfg, tp_size, pp, vpp, m, schedule)
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
            "tied_equal": got["tied_equal"],
        }
    return out


def test_pipeline_layouts_equal_one_process():
    results = run_distributed(_pipelines_against_one_process, world_size=4, timeout=400)
    for rank, out in enumerate(results):
        for name, (_, pp, _, _, _) in LAYOUTS.items():
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
            # The tied embedding's two copies stay equal on both ends.
            first_stage = r["pp_rank"] == 0
            assert r["tied_equal"] is (True if first_stage or last_stage else None), where
        # 1F1B with 8 microbatches over 4 stages: rank r keeps pp - r microbatches alive
        # between forward and backward; so does ZB-H1 (its weight gradients keep less).
        for name, pp in (("pp4", 4), ("pp2", 2), ("pp4_zb", 4), ("pp2_zb", 2)):
            assert out[name]["peak_live"] == pp - out[name]["pp_rank"], (rank, name)
        zb = out["pp4_zb"]
        assert " ".join(map(repr, zb["order"])) == " ".join(
            repr(s) for s in pipe.order_zb_h1(8, 4, zb["pp_rank"]) if s.kind != "W"
        ), rank
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
        assert " ".join(map(repr, pipe.compute_steps(table))) == expected
    # 1F1B: warm-up of pp - rank - 1 forwards.
    assert _compute(pipe.schedule_1f1b(4, 4, 1)) == "F0 F1 F2 B0 F3 B1 B2 B3"
    assert _compute(pipe.schedule_1f1b(2, 4, 0)) == "F0 F1 B0 B1"
    # Megatron's batches at pp=2: each is the mirror image of the neighbour's of the same
    # index (send_forward_recv_backward on one side, send_backward_recv_forward on the other).
    # Each transfer is a batch of its own, each send right after its step, each receive as
    # early as the order of transfers allows: the last stage asks for F1's input before it
    # starts F0, so it arrives while F0 and B0 run.
    assert " ".join(map(repr, pipe.schedule_1f1b(3, 2, 0))) == (
        "F0 [>next F0] F1 [>next F1] [<next B0] B0 F2 [>next F2] [<next B1] [<next B2] B1 B2"
    )
    assert " ".join(map(repr, pipe.schedule_1f1b(3, 2, 1))) == (
        "[<prev F0] [<prev F1] F0 B0 [>prev B0] [<prev F2] F1 B1 [>prev B1] F2 B2 [>prev B2]"
    )
    assert repr(pipe.schedule_1f1b(4, 4, 1)[:6]) == (
        "[[<prev F0], [<prev F1], F0, [>next F0], [<prev F2], F1]"
    )
    # ZB-H1 at pp 4: rank r runs pp - r forwards, then B, W, F; the last rank defers its
    # first three Ws to the end (Qi et al.'s figure), and the tables' clock shows the
    # bubble at a third of 1F1B's.
    assert _compute(pipe.schedule_zb_h1(6, 4, 3)) == (
        "F0 B0 F1 B1 F2 B2 F3 B3 W0 F4 B4 W1 F5 B5 W2 W3 W4 W5"
    )
    assert _compute(pipe.schedule_zb_h1(6, 4, 0)) == (
        "F0 F1 F2 F3 B0 W0 F4 B1 W1 F5 B2 W2 B3 W3 B4 W4 B5 W5"
    )
    orders = {
        "1f1b": ([pipe.order_1f1b(16, 4, r) for r in range(4)], 1, pipe.COSTS),
        "interleaved": (
            [pipe.order_interleaved(16, 4, r, 2) for r in range(4)],
            2,
            pipe.COSTS,
        ),
        "zb-h1": ([pipe.order_zb_h1(16, 4, r) for r in range(4)], 1, pipe.SPLIT_COSTS),
    }
    bubbles = {k: pipe.bubble(*v) for k, v in orders.items()}
    assert bubbles == {"1f1b": 3 / 16, "interleaved": 3 / 32, "zb-h1": 3 / 48}
    assert pipe.schedule_zb_h1(4, 2, 1, forward_only=True) == pipe.schedule_1f1b(
        4, 2, 1, forward_only=True
    )
    # ZB-H1's memory: rank r holds at most pp - r microbatches between F and B (1F1B's), and
    # at most pp between F and W (1F1B's peak, rank 0's): r of them wait only for their W.
    for pp in (2, 4, 8):
        for m in (1, pp - 1, pp, 2 * pp, 16):
            for r in range(pp):
                order = pipe.order_zb_h1(m, pp, r)
                assert sorted(map(repr, order)) == sorted(
                    f"{k}{i}" for k in "FBW" for i in range(m)
                ), (pp, m, r)
                live = {"F": 0, "B": 0, "W": 0}
                to_b = to_w = 0
                for step in order:
                    live[step.kind] += 1
                    to_b = max(to_b, live["F"] - live["B"])
                    to_w = max(to_w, live["F"] - live["W"])
                assert to_b == min(pp - r, m) and to_w <= pp, (pp, m, r, to_b, to_w)
    with pytest.raises(
        ValueError, match=r"num_microbatches \(6\) to be a multiple of .* \(4\); use 8"
    ):
        pipe.schedule_interleaved(6, 4, 0, 2)


def _compute(table) -> str:
    return " ".join(map(repr, pipe.compute_steps(table)))


def _batch_with(comm, rank, pp, vpp, peer):
    """What a batch sends to and receives from one peer, in posting order, each tensor named
    by the step of the peer it comes from or goes to (so both sides of a pair compare equal).
    A stage's output feeds the same chunk on the next rank, or the next chunk when it wraps
    from the last rank to the first."""
    nxt, prv = (rank + 1) % pp, (rank - 1) % pp
    wrap_next, wrap_prev = int(rank == pp - 1), int(rank == 0)
    ops = []
    if comm.send_next is not None and peer == nxt:
        s = comm.send_next
        ops.append(("send", "act", Step("F", s.microbatch, s.chunk + wrap_next)))
    if comm.recv_prev is not None and peer == prv:
        ops.append(("recv", "act", comm.recv_prev))
    if comm.send_prev is not None and peer == prv:
        s = comm.send_prev
        ops.append(("send", "grad", Step("B", s.microbatch, s.chunk - wrap_prev)))
    if comm.recv_next is not None and peer == nxt:
        ops.append(("recv", "grad", comm.recv_next))
    return ops


def _run_tables(tables, pp, vpp):
    """Play the tables as the NCCL-rules checker runs them, which is stricter than NCCL: a
    rank posting a batch waits until each peer has posted its batch of the same index with
    it, which must mirror it; only then are the batch's transfers issued, and a tensor
    arrives once its sender's batch has been issued; a compute step needs its input to have
    arrived.  Returns the number of batches; raises on a mismatch or a deadlock."""
    at = [0] * pp
    posted: dict[tuple[int, int], dict[int, int]] = {}  # (rank, item) -> peer -> batch index
    count: dict[tuple[int, int], int] = {}
    arrived = [set() for _ in range(pp)]
    by_index: dict[tuple[int, int, int], list] = {}  # (rank, peer, index) -> ops
    while any(at[r] < len(tables[r]) for r in range(pp)):
        moved = False
        for r in range(pp):
            while at[r] < len(tables[r]):
                item = tables[r][at[r]]
                if isinstance(item, Step):
                    needs = (item.kind == "F" and not (r == 0 and item.chunk == 0)) or (
                        item.kind == "B" and not (r == pp - 1 and item.chunk == vpp - 1)
                    )
                    if needs and item not in arrived[r]:
                        break  # its input is still on the way
                    at[r] += 1
                    moved = True
                    continue
                peers = [p for p in range(pp) if p != r and _batch_with(item, r, pp, vpp, p)]
                if (r, at[r]) not in posted:
                    posted[(r, at[r])] = {}
                    for p in peers:
                        index = count.get((r, p), 0)
                        count[(r, p)] = index + 1
                        posted[(r, at[r])][p] = index
                        by_index[(r, p, index)] = _batch_with(item, r, pp, vpp, p)
                ready = all((p, r, posted[(r, at[r])][p]) in by_index for p in peers)
                if not ready:
                    break
                for p in peers:
                    mine = by_index[(r, p, posted[(r, at[r])][p])]
                    theirs = by_index[(p, r, posted[(r, at[r])][p])]
                    for mine_op, their_op in (("send", "recv"), ("recv", "send")):
                        a = [(k, s) for d, k, s in mine if d == mine_op]
                        b = [(k, s) for d, k, s in theirs if d == their_op]
                        assert a == b, (r, p, mine, theirs)
                # Issued: what it sends arrives at the neighbours.
                for p in peers:
                    arrived[p].update(
                        s for d, _, s in _batch_with(item, r, pp, vpp, p) if d == "send"
                    )
                at[r] += 1
                moved = True
        assert moved, f"deadlock: {[tables[r][at[r]] for r in range(pp) if at[r] < len(tables[r])]}"
    return sum(count.values())


@pytest.mark.parametrize("forward_only", [False, True])
def test_schedule_tables_meet_nccl_rules(forward_only):
    """Every rank's table against its neighbours', for many shapes, without processes."""
    for pp in (2, 3, 4, 8):
        for m in (1, 2, 3, 4, 5, 8, 16):
            for make in (pipe.schedule_1f1b, pipe.schedule_zb_h1):
                tables = [make(m, pp, r, forward_only) for r in range(pp)]
                assert _run_tables(tables, pp, 1) > 0
        for vpp in (2, 3, 4):
            for m in (pp, 2 * pp, 3 * pp):
                tables = [pipe.schedule_interleaved(m, pp, r, vpp, forward_only) for r in range(pp)]
                assert _run_tables(tables, pp, vpp) > 0
    # The table player does catch what NCCL would hang on: the old unfused order, where a
    # forward's send and the next backward's receive were separate batches.
    old = []
    for r in range(2):
        table = []
        for step in pipe.compute_steps(pipe.schedule_1f1b(4, 2, r)):
            if step.kind == "F" and r == 1:
                table.append(pipe.Comm(recv_prev=step))
            if step.kind == "B" and r == 0:
                table.append(pipe.Comm(recv_next=step))
            table.append(step)
            if step.kind == "F" and r == 0:
                table.append(pipe.Comm(send_next=step))
            if step.kind == "B" and r == 1:
                table.append(pipe.Comm(send_prev=step))
        old.append(table)
    if not forward_only:
        with pytest.raises(AssertionError):
            _run_tables(old, 2, 1)
        # ... and what the checker caught in a real run: the same transfers with a send and
        # an early receive to two different peers fused into one batch (Megatron's
        # send_forward_recv_forward): around the interleaved ring each such batch waits for
        # the next, and the player reports the cycle.
        fused = [_fuse_directions(pipe.schedule_interleaved(8, 4, r, 2)) for r in range(4)]
        with pytest.raises(AssertionError, match="deadlock"):
            _run_tables(fused, 4, 2)


def _fuse_directions(table: list) -> list:
    """Merge each transfer into the batch before it when both go one direction to two
    different peers (send to next with receive from previous, or the other two)."""
    direction = {"send_next": 0, "recv_prev": 0, "send_prev": 1, "recv_next": 1}
    out: list = []
    for item in table:
        if isinstance(item, pipe.Comm) and out and isinstance(out[-1], pipe.Comm):
            mine = {k: v for k, v in vars(item).items() if v is not None}
            last = {k: v for k, v in vars(out[-1]).items() if v is not None}
            (field,) = mine
            (other,) = last if len(last) == 1 else (field,)
            if other != field and direction[field] == direction[other]:
                out[-1] = pipe.Comm(**last, **mine)
                continue
        out.append(item)
    return out


def test_layer_assignment():
    # Megatron-LM's interleaving example: 16 layers, pp 4, vpp 2: rank 0 holds 1-2 and 9-10.
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


def test_pipeline_layout_megatron_strings_and_bridge_lists():
    # Megatron-Bridge's DeepSeek-V3 layouts: pp 4 x vp 4 without MTP, pp 8 x vp 4 with one.
    assert pipe.parse_pipeline_layout("Et*4|(t*4|)*14tL", 4, 4, 61) == [4] * 15 + [1]
    h100 = pipe.parse_pipeline_layout("Et|(tt|)*30mL", 8, 4, 61, mtp_num_layers=1)
    assert h100 == [1] + [2] * 30 + [0]  # the last stage holds only the MTP depth and loss
    bridge = [["embedding", "decoder"], ["decoder", "decoder"], ["decoder"], ["mtp", "loss"]]
    assert pipe.parse_pipeline_layout(bridge, 2, 2, 4, 1) == [1, 2, 1, 0]
    # Virtual stage c * pp + r is chunk c of rank r: rank 0 holds layers 0 and 3.
    h = [1, 2, 1, 0]
    chunks = [[pipe.layers_for(4, r, 2, 2, v, stage_layers=h) for v in range(2)] for r in range(2)]
    assert chunks == [[[0], [3]], [[1, 2], []]]
    refusals = {
        "Et|t|x": "'x' is not a layout letter",
        "Et|t": "has 2 stages; .* 2 x 2 = 4",
        "tE|t|t|L": "embedding \\(E\\) must open the first stage",
        "Et|tL|t|t": "loss \\(L\\) must close the last stage",
        "Et|tm|t|L": "must end with the model's 1 MTP depth",
        "Et|t|t|mL": "holds 3 transformer layers .*num_layers is 4",
    }
    for layout, message in refusals.items():
        with pytest.raises(ValueError, match=message):
            pipe.parse_pipeline_layout(layout, 2, 2, 4, 1)
    with pytest.raises(ValueError, match="stage 1 is 'decoder'"):
        pipe.parse_pipeline_layout([["embedding", "loss"], "decoder"], 2, None, 0)
    with pytest.raises(ValueError, match="hold 3 transformer layers"):
        pipe.layers_for(4, 0, 2, None, stage_layers=[2, 1])


def _p2p_exchanges():
    from megacore.pipeline_parallel.p2p_communication import communicate

    out = {}
    # pp=4: variable shapes forward, fixed shapes in the combined forms.
    ps.initialize_model_parallel(1, 4)
    r = ps.get_pipeline_model_parallel_rank()
    first, last = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
    got = communicate(recv_prev=not first, variable_seq_lengths=True)[0]
    sent = None if last else torch.full((3 + r, 2), float(r))
    communicate(tensor_send_next=sent, variable_seq_lengths=True)
    out["variable"] = None if got is None else (tuple(got.shape), got.unique().tolist())
    # Every stage but the last sends forward and receives a gradient in one exchange; its
    # neighbour receives that activation and sends a gradient back in the mirror exchange.
    shape = (2, 3)
    fwd = None
    if not first:
        grad_out = torch.full(shape, 100.0 + r)
        fwd = communicate(tensor_send_prev=grad_out, recv_prev=True, tensor_shape=shape)[0]
    grad = None
    if not last:
        act = torch.full(shape, 10.0 + r)
        grad = communicate(tensor_send_next=act, recv_next=True, tensor_shape=shape)[1]
    out["combined"] = (
        None if fwd is None else fwd.unique().tolist(),
        None if grad is None else grad.unique().tolist(),
        None if fwd is None else fwd.requires_grad,
    )
    ps.destroy_model_parallel()

    # pp=2 with both directions to the same peer at once: tags keep them apart.
    ps.initialize_model_parallel(1, 2)
    r = ps.get_pipeline_model_parallel_rank()
    from_prev, from_next, _ = communicate(
        tensor_send_next=torch.full(shape, 1.0 + r),
        tensor_send_prev=torch.full(shape, -1.0 - r),
        recv_prev=True,
        recv_next=True,
        tensor_shape=shape,
    )
    out["same_peer"] = (from_prev.unique().tolist(), from_next.unique().tolist())
    ps.destroy_model_parallel()
    return out


def _no_pipelining_with_ddp():
    """dp=4: gradients accumulate locally and all-reduce only during the last microbatch."""
    ps.initialize_model_parallel(1, 1)
    tp.model_parallel_manual_seed(0)
    cfg = TinyConfig(layers=2)
    model = TinyStack(cfg)
    ddp = torch.nn.parallel.DistributedDataParallel(
        model, process_group=ps.get_data_parallel_group()
    )
    calls = []

    def counting_hook(state, bucket):
        calls.append(recorder.forwards.get(0, 0))
        return allreduce_hook(state, bucket)

    ddp.register_comm_hook(ps.get_data_parallel_group(), counting_hook)
    rank = ps.get_data_parallel_rank()
    data = _microbatches(cfg, 16, 0)[rank * 4 : rank * 4 + 4]  # each replica its own 4
    recorder = _Recorder()
    _schedule(recorder, iter(data), ddp, 4)
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    # One process over all 16 microbatches, the mean over them.
    model.zero_grad(set_to_none=True)
    for tokens, targets in _microbatches(cfg, 16, 0):
        (model(tokens, targets) / 16).backward()
    diff = max((grads[n] - p.grad).abs().max().item() for n, p in model.named_parameters())
    ps.destroy_model_parallel()
    return {
        "allreduce_during_forward_count": sorted(set(calls)),
        "n_calls": len(calls),
        "diff": diff,
    }


def _evaluate_forward_only():
    """Forward-only evaluation at pp=4 gives the one-process loss and keeps no graph."""
    cfg = TinyConfig(layers=4)
    data = _microbatches(cfg, 4, 9)
    ps.initialize_model_parallel(1, 1)
    tp.model_parallel_manual_seed(0)
    reference = sum(TinyStack(cfg)(t, y).item() for t, y in data) / 4
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(1, 4)
    tp.model_parallel_manual_seed(0)
    (chunk,) = build_chunks(cfg, 4, None)
    recorder = _Recorder()
    infos = _schedule(recorder, iter(data), chunk, 4, hidden_size=cfg.hidden, forward_only=True)
    # Megatron-style: hidden size from model.config, non-loss data collected on the last stage.
    chunk.config = types.SimpleNamespace(hidden_size=cfg.hidden)

    def forward_step(data_iterator, model):
        out = model(*next(data_iterator))
        return out, lambda o, non_loss_data=False: ("collected", tuple(o.shape))

    collected = pipe.get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter(data),
        model=chunk,
        num_microbatches=4,
        seq_length=SEQ,
        micro_batch_size=MICRO_BATCH,
        forward_only=True,
        collect_non_loss_data=True,
    )
    # ZB-H1 evaluates with 1F1B's forward table: the same loss.
    zb = _schedule(
        _Recorder(), iter(data), chunk, 4, "zb-h1", hidden_size=cfg.hidden, forward_only=True
    )
    refusals = []
    for schedule, model in (("interleaved", chunk), ("gpipe", chunk), ("zb-h1", _TorchDDP())):
        try:
            _schedule(_Recorder(), iter(data), model, 4, schedule, hidden_size=cfg.hidden)
            refusals.append(None)
        except ValueError as e:
            refusals.append(str(e))
    last = ps.is_pipeline_last_stage()
    ps.destroy_model_parallel()
    return {
        "zb_loss": sum(i["loss"].item() for i in zb) / 4 if last else None,
        "refusals": refusals,
        "loss": sum(i["loss"].item() for i in infos) / 4 if last else None,
        "reference": reference,
        "peak_live": recorder.peak,
        "order": " ".join(map(repr, recorder.order)),
        "collected": collected,
    }


class _TorchDDP(torch.nn.parallel.DistributedDataParallel):
    """Stands for torch's DDP in a type check (not built: no process group needed)."""

    def __init__(self):
        torch.nn.Module.__init__(self)


def _p2p_ddp_and_eval():
    return {
        "p2p": _p2p_exchanges(),
        "ddp": _no_pipelining_with_ddp(),
        "eval": _evaluate_forward_only(),
    }


def test_p2p_no_pipelining_and_forward_only():
    results = run_distributed(_p2p_ddp_and_eval, world_size=4, timeout=300)
    for rank, out in enumerate(results):
        p2p = out["p2p"]
        assert p2p["variable"] == (None if rank == 0 else ((3 + rank - 1, 2), [float(rank - 1)]))
        assert p2p["combined"] == (
            None if rank == 0 else [10.0 + rank - 1],
            None if rank == 3 else [100.0 + rank + 1],
            None if rank == 0 else True,
        )
        peer = 1 - rank // 2  # pp=2 on 4 ranks: pipelines [0, 2] and [1, 3]
        assert p2p["same_peer"] == ([1.0 + peer], [-1.0 - peer])

        ddp = out["ddp"]
        # Every bucket all-reduce happened in the backward of the 4th (last) microbatch.
        assert ddp["allreduce_during_forward_count"] == [4] and ddp["n_calls"] >= 1
        assert ddp["diff"] < 1e-6

        ev = out["eval"]
        if rank == 3:
            assert ev["loss"] == pytest.approx(ev["reference"], abs=1e-6)
            assert ev["zb_loss"] == ev["loss"]
        interleaved, unknown, torch_ddp = ev["refusals"]
        assert "'interleaved' with a virtual pipeline size of 1" in interleaved
        assert "unknown schedule 'gpipe'" in unknown
        assert "zb-h1: torch's DistributedDataParallel" in torch_ddp
        assert ev["peak_live"] == 0  # no graph kept in evaluation
        assert ev["order"] == "F0 F1 F2 F3"
        assert ev["collected"] == ([("collected", ())] * 4 if rank == 3 else [])
