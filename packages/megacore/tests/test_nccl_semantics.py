"""The NCCL-rules checker catches what gloo forgives: it must fail where NCCL would hang.

One 4-rank spawn, run without the checker that `run_distributed` normally puts
around every rank, opens its own `nccl_semantics` blocks around scenarios that
NCCL refuses, and one it accepts:

- the pipeline schedule as it was before the tables (each send its own batch,
  posted after the step, then a blocking receive) at pp=2 (dp=2) and pp=4: a
  mismatch named with both ranks, their batches and schedule steps, or a
  deadlock report;
- the tables' batches for 1F1B, interleaved and ZB-H1, one direction per batch
  and each receive posted as early as the tables allow, every post waiting for
  its peer's match (stricter than NCCL): accepted;
- two sends to one peer received in the other order (NCCL ignores tags);
- a peer that never posts its batch;
- a tensor on another device, and a non-contiguous one, handed to collectives,
  including through megacore's own name for all-gather.
"""

import torch
import torch.distributed as dist

from megacore import collectives
from megacore import parallel_state as ps
from megacore import pipeline_parallel as pipe
from megacore.pipeline_parallel.p2p_communication import communicate
from megacore.testing import NCCLSemanticsError, nccl_semantics, run_distributed

SHAPE = (2, 3)
ALL_GATHER_FLAT = collectives.all_gather_flat
ALL_REDUCE = dist.all_reduce
_at = ["start"]  # the emulated schedule's step, for the checker's messages
_NO_WAIT = {"tensor_shape": SHAPE, "wait": False}
_in_flight = []  # gloo aborts a send whose request is dropped: keep them, as the old executor did


def _where() -> str:
    return f"step {_at[0]}"


def _unfused_1f1b(pp: int, microbatches: int) -> None:
    """The old executor's communication: blocking receives, each send a batch of its own."""
    r = ps.get_pipeline_model_parallel_rank()
    first, last = r == 0, r == pp - 1
    for step in pipe.compute_steps(pipe.schedule_1f1b(microbatches, pp, r)):
        _at[0] = repr(step)
        if step.kind == "F":
            if not first:
                communicate(recv_prev=True, tensor_shape=SHAPE)
            if not last:
                sent = communicate(
                    tensor_send_next=torch.ones(SHAPE), tensor_shape=SHAPE, wait=False
                )
                _in_flight.append(sent)
        else:
            if not last:
                communicate(recv_next=True, tensor_shape=SHAPE)
            if not first:
                sent = communicate(
                    tensor_send_prev=torch.ones(SHAPE), tensor_shape=SHAPE, wait=False
                )
                _in_flight.append(sent)


def _table(schedule: str):
    def run(pp: int, microbatches: int) -> int:
        """The table's batches as the executor posts them; returns how many were posted."""
        r = ps.get_pipeline_model_parallel_rank()
        if schedule == "interleaved":
            return _post(pipe.schedule_interleaved(microbatches, pp, r, 2))
        make = pipe.schedule_zb_h1 if schedule == "zb-h1" else pipe.schedule_1f1b
        return _post(make(microbatches, pp, r))

    return run


def _post(table: list) -> int:
    posted = 0
    for item in table:
        _at[0] = repr(item)
        if isinstance(item, pipe.Comm):
            communicate(
                tensor_send_next=None if item.send_next is None else torch.ones(SHAPE),
                tensor_send_prev=None if item.send_prev is None else torch.ones(SHAPE),
                recv_prev=item.recv_prev is not None,
                recv_next=item.recv_next is not None,
                tensor_shape=SHAPE,
            )
            posted += 1
    return posted


def _attempt(fn, *args, timeout: float = 5.0, device=None) -> str:
    """Run `fn` under the checker; the checker's error message, or "ok"."""
    try:
        with nccl_semantics(device=device, timeout=timeout, where=_where):
            fn(*args)
        return "ok"
    except NCCLSemanticsError as e:
        return str(e)
    finally:
        dist.barrier()  # outside the checker: every rank leaves the scenario before the next


def _pipeline(pp: int, fn, microbatches: int = 4, vpp: int | None = None):
    def run():
        ps.initialize_model_parallel(1, pp, vpp)
        try:
            fn(pp, microbatches)
        finally:
            ps.destroy_model_parallel()

    return run


def _swapped_tags():
    a, b = torch.zeros(SHAPE), torch.ones(SHAPE)
    if dist.get_rank() == 0:  # an activation (tag 0) then a gradient (tag 1)
        ops = [dist.P2POp(dist.isend, a, 1, tag=0), dist.P2POp(dist.isend, b, 1, tag=1)]
    elif dist.get_rank() == 1:  # received the other way round: NCCL would swap them
        ops = [dist.P2POp(dist.irecv, b, 0, tag=1), dist.P2POp(dist.irecv, a, 0, tag=0)]
    else:
        return
    for work in dist.batch_isend_irecv(ops):
        work.wait()


def _absent_peer():
    if dist.get_rank() == 0:
        dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.ones(SHAPE), 1)])


def _all_reduce_cpu():
    dist.all_reduce(torch.ones(SHAPE))


def _all_reduce_transposed():
    dist.all_reduce(torch.ones(SHAPE).t())


def _all_gather_flat_strided():
    """Through the name megacore's modules bound at import (the test module's own is not)."""
    out = torch.empty(dist.get_world_size() * 6)
    collectives.all_gather_flat(out, torch.ones(12)[::2])


def _scenarios():
    return {
        "unfused_pp2": _attempt(_pipeline(2, _unfused_1f1b)),
        "unfused_pp4": _attempt(_pipeline(4, _unfused_1f1b, 8)),
        "table_pp4": _attempt(_pipeline(4, _table("1f1b"), 8)),
        "table_pp2": _attempt(_pipeline(2, _table("1f1b"), 3)),
        "table_zb_pp4": _attempt(_pipeline(4, _table("zb-h1"), 8)),
        "table_zb_pp2": _attempt(_pipeline(2, _table("zb-h1"), 5)),
        "table_interleaved_pp4": _attempt(_pipeline(4, _table("interleaved"), 8, vpp=2)),
        "table_interleaved_pp2": _attempt(_pipeline(2, _table("interleaved"), 4, vpp=2)),
        "swapped_tags": _attempt(_swapped_tags),
        "absent_peer": _attempt(_absent_peer, timeout=2.0),
        "device": _attempt(_all_reduce_cpu, device="meta"),
        "contiguous": _attempt(_all_reduce_transposed),
        "megacore_name": _attempt(_all_gather_flat_strided),
        # Outside the block gloo is itself again: nothing is left patched.
        "restored": collectives.all_gather_flat is ALL_GATHER_FLAT
        and dist.all_reduce is ALL_REDUCE,
    }


def test_checker_refuses_what_nccl_refuses():
    results = run_distributed(_scenarios, world_size=4, timeout=240, nccl_rules=False)
    # pp=2 on 4 ranks: pipelines [0, 2] and [1, 3].  The first stage's second send meets the
    # last stage's first gradient send: both ranks name the pair, both batches and both steps.
    for rank in range(4):
        msg = results[rank]["unfused_pp2"]
        low = rank % 2
        assert f"batch #1 between ranks {low} and {low + 2} does not match" in msg, msg
        assert f"rank {low} posted [send tag 0 (2, 3) float32] at step F1" in msg, msg
        assert f"rank {low + 2} posted [send tag 1 (2, 3) float32] at step B0" in msg, msg
    # pp=4: stages 2 and 3 mismatch first; stages 0 and 1 then wait for batches that never
    # come, and say so with what their peer is stuck on.
    pp4 = [results[r]["unfused_pp4"] for r in range(4)]
    assert all(m != "ok" for m in pp4), pp4
    assert "between ranks 2 and 3 does not match" in pp4[2] and pp4[2] == pp4[3], pp4
    assert "rank 1 waited 5 s for rank 2's batch" in pp4[1], pp4[1]
    assert "under NCCL this hangs" in pp4[1] and "Rank 2's last batch: with rank" in pp4[1]
    for rank, out in enumerate(results):
        tables = [v for k, v in out.items() if k.startswith("table_")]
        assert len(tables) == 6 and all(v == "ok" for v in tables), (rank, out)
        assert out["restored"] is True
        assert "NCCL takes only tensors on the rank's device" in out["device"], out["device"]
        assert "all_reduce got a tensor (2, 3) float32 on cpu" in out["device"]
        assert "all_reduce got a non-contiguous tensor (3, 2)" in out["contiguous"]
        assert "got a non-contiguous tensor (6,) float32 (strides (2,))" in out["megacore_name"]
    swapped = results[0]["swapped_tags"]
    assert "batch #0 between ranks 0 and 1 does not match" in swapped, swapped
    assert results[1]["swapped_tags"] == swapped and results[2]["swapped_tags"] == "ok"
    absent = results[0]["absent_peer"]
    assert "rank 0 waited 2 s for rank 1's batch #0" in absent, absent
    assert "Rank 1's last batch: none posted" in absent, absent
    assert results[1]["absent_peer"] == "ok"
