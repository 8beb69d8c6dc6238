"""Checkpoints under real gloo groups: exact resume, layout changes, crashes mid-save, bad files."""

import bisect
import gc
import math
import os
import pickle
import re
import shutil

import numpy as np
import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from megacore import parallel_state as ps
from megacore.testing import DistributedTestError, run_distributed
from megatrain.checkpoint.dcp import flat_range_boxes, named_params
from megatrain.checkpoint.files import CheckpointError, find_checkpoint, read_meta
from megatrain.checkpoint.load import (
    _load_tensors,
    check_model_matches,
    load_checkpoint,
    read_full_state,
)
from megatrain.checkpoint.save import save_checkpoint
from megatrain.config import load_config
from megatrain.run.distributed import init_distributed
from megatrain.run.loop import resume, train
from megatrain.run.setup import build_run
from megatrain.run.step import evaluate, train_step
from megatrain.testing import random_documents, write_corpus

VOCAB = 200
BASE = [
    "model.num_layers=4",
    "model.hidden_size=32",
    "model.num_attention_heads=4",
    "model.max_position_embeddings=32",
    "model.make_vocab_size_divisible_by=64",
    "model.hidden_dropout=0.1",  # dropout on: the generators must resume too
    "model.attention_dropout=0.1",
    "training.seq_length=16",
    "training.micro_batch_size=2",
    "training.global_batch_size=8",
    "training.train_iters=6",
    "training.eval_interval=3",
    "training.eval_iters=1",
    "optimizer.lr=0.01",
    "optimizer.lr_warmup_iters=2",
    "logging.log_interval=1",
    "logging.tensorboard=false",
    "logging.peak_tflops=1.0",
]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    rng = np.random.default_rng(3)

    def docs(n):
        return random_documents(rng, n, VOCAB, 10, 50)

    root = tmp_path_factory.mktemp("corpus")
    return str(
        write_corpus(root, {"train": [docs(50), docs(50)], "valid": [docs(20)]}, vocab_size=VOCAB)
    )


def _config(corpus, out, *overrides):
    return load_config(
        None, [*BASE, f"data.corpus={corpus!r}", f"training.output_dir={out!r}", *overrides]
    )


def _resume_runs(corpus, out):
    """Uninterrupted 6 steps against 3 steps, a save, and 3 more after loading."""
    results = {}
    for dist_opt in ("false", "true"):
        layout = [
            "parallel.tensor_model_parallel_size=2",
            f"parallel.use_distributed_optimizer={dist_opt}",
        ]
        ckpt = f"{out}/ckpt-{dist_opt}"
        full = train(_config(corpus, f"{out}/full-{dist_opt}", *layout))
        first = train(
            _config(corpus, f"{out}/first-{dist_opt}", *layout, "training.exit_interval=3",
                    f"checkpoint.save={ckpt!r}")
        )  # fmt: skip
        second = train(
            _config(corpus, f"{out}/second-{dist_opt}", *layout, f"checkpoint.load={ckpt!r}")
        )
        results[dist_opt] = (full, first, second)
    return results


def test_resume_is_exact(corpus, tmp_path):
    results = run_distributed(_resume_runs, 4, args=(corpus, str(tmp_path)), timeout=300)[0]
    for name, (full, first, second) in results.items():
        assert first["stopped_at"] == 3 and len(first["loss"]) == 3
        assert first["loss"] + second["loss"] == full["loss"], name  # bitwise
        assert first["grad_norm"] + second["grad_norm"] == full["grad_norm"], name
        assert second["valid"] == [v for v in full["valid"] if v[0] > 3], name
    assert (tmp_path / "ckpt-true" / "latest").read_text().strip() == "iter_0000003"


RESHARD = {  # the layouts a tp2-pp2-dp2 checkpoint (distributed optimizer) is loaded at
    "tp2-pp2-dp2": ["parallel.tensor_model_parallel_size=2",
                    "parallel.pipeline_model_parallel_size=2",
                    "parallel.use_distributed_optimizer=true"],
    "tp1-pp1-dp8-micro1": ["training.micro_batch_size=1"],
    "tp4-pp1-dp2-distopt": ["parallel.tensor_model_parallel_size=4",
                            "parallel.use_distributed_optimizer=true"],
    "tp1-pp4-dp2": ["parallel.pipeline_model_parallel_size=4"],
}  # fmt: skip
NO_DROPOUT = ["model.hidden_dropout=0.0", "model.attention_dropout=0.0"]


def _valid_loss_at_load(config):

    device, _ = init_distributed()
    run = build_run(config, device)
    try:
        resume(run)
        return run.iteration, evaluate(run)
    finally:
        ps.destroy_model_parallel()


def _same_checkpoint(a, b) -> dict | None:
    """On rank 0: which of two checkpoints' tensors and meta.json's run state differ (None on
    the other ranks)."""
    import torch.distributed as dist

    if dist.get_rank() != 0:
        return None
    (meta_a, state_a), (meta_b, state_b) = (
        read_full_state(c, with_optimizer=True, progress=False) for c in (a, b)
    )
    return {
        "names": sorted(state_a) == sorted(state_b) and len(state_a) > 0,
        "tensors": [n for n in state_a if not torch.equal(state_a[n], state_b.get(n))],
        "meta": [k for k in ("iteration", "data", "optimizer", "layout") if meta_a[k] != meta_b[k]],
    }


def _reshard_runs(corpus, out):
    ckpt = f"{out}/ckpt"
    saved = train(
        _config(corpus, f"{out}/save", *RESHARD["tp2-pp2-dp2"], *NO_DROPOUT,
                "training.exit_interval=3", f"checkpoint.save={ckpt!r}")
    )  # fmt: skip
    reference = train(_config(corpus, f"{out}/reference", *RESHARD["tp2-pp2-dp2"], *NO_DROPOUT))
    # The same run saving every iteration in the background (checkpoint.async_save).
    background = train(
        _config(corpus, f"{out}/async", *RESHARD["tp2-pp2-dp2"], *NO_DROPOUT,
                "training.exit_interval=3", f"checkpoint.save={ckpt + '-async'!r}",
                "checkpoint.save_interval=1", "checkpoint.async_save=true")
    )  # fmt: skip
    results = {"async": (background, _same_checkpoint(ckpt, ckpt + "-async"))}
    for name, layout in RESHARD.items():
        config = _config(corpus, f"{out}/{name}", *layout, *NO_DROPOUT, f"checkpoint.load={ckpt!r}")
        at_load = _valid_loss_at_load(config)
        results[name] = (at_load, train(config))
    return saved, reference, results


def test_checkpoint_loads_at_other_layouts(corpus, tmp_path):
    """A tp 2 x pp 2 x dp 2 checkpoint (distributed optimizer) loads at other layouts; saved in
    the background instead, its run and its tensors are the same."""
    saved, reference, results = run_distributed(
        _reshard_runs, 8, args=(corpus, str(tmp_path)), timeout=400
    )[0]
    assert saved["valid"][-1][0] == 3
    # Saved in the background every iteration: the same steps, bitwise, and the same tensors
    # in the checkpoint as the synchronous save's.
    background, same = results.pop("async")
    assert background["loss"] == saved["loss"] and background["grad_norm"] == saved["grad_norm"]
    assert same == {"names": True, "tensors": [], "meta": []}, same
    for name, ((iteration, valid), resumed) in results.items():
        # The weights: the same validation loss as the saving run computed at iteration 3.
        assert iteration == 3 and abs(valid - saved["valid"][-1][1]) < 2e-5, name
        # The optimizer state: steps 4 to 6 as the uninterrupted run took them.
        for a, b in zip(resumed["loss"], reference["loss"][3:], strict=True):
            assert abs(a - b) < 2e-5, (name, resumed["loss"], reference["loss"])
        for a, b in zip(resumed["grad_norm"], reference["grad_norm"][3:], strict=True):
            assert abs(a - b) < 2e-5 * b, name


def _killed_mid_save(corpus, out):
    """Saves at iterations 2 and 4; the process dies inside the second save."""
    import os

    import torch

    real_save = torch.save

    def dying_save(obj, path, *args, **kwargs):
        if "iter_0000004" in str(path):
            os._exit(9)  # after the weights and optimizer state, before meta.json and `latest`
        return real_save(obj, path, *args, **kwargs)

    torch.save = dying_save
    train(_config(corpus, out, "checkpoint.save_interval=2", f"checkpoint.save={out + '/ckpt'!r}"))


def _resume_after_kill(corpus, out):
    return train(_config(corpus, out + "/after", f"checkpoint.load={out + '/ckpt'!r}"))


@pytest.fixture(scope="module")
def killed_checkpoint(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("killed")
    with pytest.raises(DistributedTestError, match="exited with code 9"):
        run_distributed(_killed_mid_save, 2, args=(corpus, str(out)), timeout=120)
    resumed = run_distributed(_resume_after_kill, 2, args=(corpus, str(out)), timeout=120)[0]
    return out / "ckpt", resumed


def test_a_process_killed_mid_save_leaves_the_previous_checkpoint(killed_checkpoint):
    ckpt, resumed = killed_checkpoint
    assert (ckpt / "latest").read_text().strip() == "iter_0000002"
    assert (ckpt / ".tmp-iter_0000004" / "model" / ".metadata").is_file()  # half written
    assert not (ckpt / "iter_0000004").exists()
    assert len(resumed["loss"]) == 4  # iterations 3 to 6, from iteration 2


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_bad_checkpoints_are_refused_with_the_file(killed_checkpoint, tmp_path):
    from megatrain.models import GPTConfig

    ckpt, _ = killed_checkpoint
    no_latest = _copy(ckpt, tmp_path / "no-latest")
    (no_latest / "latest").unlink()
    with pytest.raises(CheckpointError, match=r"latest does not exist.*iter_0000002"):
        find_checkpoint(no_latest)
    gone = _copy(ckpt, tmp_path / "gone")
    shutil.rmtree(gone / "iter_0000002")
    with pytest.raises(
        CheckpointError, match=r"names 'iter_0000002', but .*meta.json does not exist"
    ):
        find_checkpoint(gone)
    cut = _copy(ckpt, tmp_path / "cut")
    shard = next((cut / "iter_0000002" / "model").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=rf"{shard.name} has 100 bytes, \d+ when saved"):
        find_checkpoint(cut)
    directory = find_checkpoint(ckpt)
    other = GPTConfig(num_layers=6, hidden_size=32, num_attention_heads=2, vocab_size=256,
                      max_position_embeddings=32)  # fmt: skip
    differs = r"another model \(num_layers: saved 4, here 6; num_attention_heads: saved 4, here 2\)"
    with pytest.raises(CheckpointError, match=differs):
        check_model_matches(read_meta(directory), other, VOCAB, directory)


def test_a_malicious_pickle_is_refused(killed_checkpoint, tmp_path):
    ckpt, _ = killed_checkpoint
    evil = _copy(ckpt, tmp_path / "evil")
    rng_file = evil / "iter_0000002" / "rng" / "rank-00000.pt"
    marker = tmp_path / "pwned"
    rng_file.write_bytes(pickle.dumps(_Exploit(str(marker)), protocol=2))
    with pytest.raises(CheckpointError, match="refusing to unpickle"):
        _load_tensors(rng_file)
    assert not marker.exists()


class _Exploit:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def _sigterm_at_iteration_2(corpus, out, *overrides):
    import signal

    import torch.distributed as dist

    from megatrain.run import loop

    real_step = loop.train_step

    def step(run, **kwargs):
        result = real_step(run, **kwargs)
        if run.iteration == 2 and dist.get_rank() == 1:  # one rank only: they must agree
            os.kill(os.getpid(), signal.SIGTERM)
        return result

    loop.train_step = step
    return train(_config(corpus, out, f"checkpoint.save={out + '/ckpt'!r}", *overrides))


@pytest.mark.parametrize("one_sync", [False, True])
def test_sigterm_saves_then_stops(corpus, tmp_path, one_sync):
    # A signal after iteration 2's step: the plain loop agrees on it at once; with one sync per
    # iteration the agreement travels with the next step's read, so iteration 3 is the last.
    overrides = ["training.one_sync_per_iteration=true"] if one_sync else []
    history = run_distributed(_sigterm_at_iteration_2, 2, args=(corpus, str(tmp_path), *overrides))
    last = 3 if one_sync else 2
    assert history[0]["stopped_at"] == last and len(history[0]["loss"]) == last
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == f"iter_000000{last}"
    assert read_meta(find_checkpoint(tmp_path / "ckpt"))["iteration"] == last


def test_flat_ranges_are_boxes():
    # Every [start, end) of a few shapes: boxes in order, each the range's next elements.
    for shape in [(5,), (3, 4), (2, 3, 4), (4, 1), (2, 1, 3, 2)]:
        full = torch.arange(math.prod(shape)).view(shape)
        for start in range(full.numel() + 1):
            for end in range(start + 1, full.numel() + 1):
                boxes = flat_range_boxes(shape, start, end)
                assert len(boxes) <= 2 * len(shape) - 1
                at = start
                for a, b, offsets, sizes in boxes:
                    box = full[tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))]
                    assert a == at and torch.equal(box.reshape(-1), torch.arange(a, b))
                    at = b
                assert at == end, (shape, start, end)


class _NewStorageBytes(TorchDispatchMode):
    """Bytes of the tensor storages allocated while active, each counted while it lives;
    `peak` is their high-water mark, `held` what the process held before (every tensor).

    A storage shows when an operation returns it or reads it (DCP's torch.load of a saved
    chunk shows when the chunk is narrowed).  Views count with their storage, once; a
    storage whose memory lies inside one held before (a slice of it) is no allocation.
    """

    def __enter__(self):
        spans = {}
        for obj in gc.get_objects():
            if type(obj) in (torch.Tensor, torch.nn.Parameter) and obj.device.type == "cpu":
                storage = obj.untyped_storage()
                if storage.nbytes():
                    spans[storage.data_ptr()] = (storage.nbytes(), StorageWeakRef(storage))
        self.starts = sorted(spans)
        self.spans = [spans[s] for s in self.starts]
        self.held = sum(n for n, _ in self.spans)
        self.new, self.now, self.peak = {}, 0, 0
        return super().__enter__()

    def _see(self, t):
        if type(t) not in (torch.Tensor, torch.nn.Parameter) or t.device.type != "cpu":
            return
        storage = t.untyped_storage()
        size, ptr = storage.nbytes(), storage.data_ptr()
        if not size or storage._cdata in self.new:
            return
        i = bisect.bisect_right(self.starts, ptr) - 1
        inside = i >= 0 and ptr + size <= self.starts[i] + self.spans[i][0]
        if inside and not self.spans[i][1].expired():
            return  # memory held before (or a slice of it)
        self.new[storage._cdata] = (StorageWeakRef(storage), size)
        self.now += size

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for key in [k for k, (ref, _) in self.new.items() if ref.expired()]:
            self.now -= self.new.pop(key)[1]
        for t in tree_leaves((args, kwargs, out)):
            if isinstance(t, torch.Tensor):
                self._see(t)
        self.peak = max(self.peak, self.now)
        return out


# A model whose optimizer state dominates (1.6M parameters, 19 MB of fp32 master + moments),
# at dp 4 under the distributed optimizer, in gradient buckets of ~300k elements.
MEMORY = ["model.num_layers=2", "model.hidden_size=256", "training.micro_batch_size=1",
          "training.global_batch_size=4", "parallel.use_distributed_optimizer=true",
          "parallel.bucket_size=300000", *NO_DROPOUT]  # fmt: skip


def _save_and_load_memory(corpus, out):
    import torch.distributed as dist

    from megatrain.checkpoint.convert import write_checkpoint

    device, _ = init_distributed()
    ckpt = f"{out}/ckpt"
    run = build_run(_config(corpus, out, *MEMORY), device)
    try:
        train_step(run)  # Adam's moments exist from here on
        with _NewStorageBytes() as train:
            train_step(run)
        with _NewStorageBytes() as save:
            save_checkpoint(run, ckpt)
        saved = [{k: v.clone() for k, v in s.items()} for _, s in run.optimizer.shard_state()]
        own = sum(s.end - s.start for s in run.optimizer.shards)
        # As a fresh run: no moments, masters other than the saved ones.
        run.optimizer.optimizer.state.clear()
        with torch.no_grad():
            for s in run.optimizer.shards:
                s.master.zero_()
        with _NewStorageBytes() as load:
            load_checkpoint(run, ckpt)
        exact = all(
            torch.equal(a[k], b[k])
            for a, (_, b) in zip(saved, run.optimizer.shard_state(), strict=True)
            for k in a
        )
        # A checkpoint whose optimizer state does not fit the model: every rank refuses it.
        if dist.get_rank() == 0:
            meta, state = read_full_state(ckpt, with_optimizer=True, progress=False)
            key = "layers.0.mlp.fc1.weight/exp_avg"
            state[key] = state[key][:, 1:]
            write_checkpoint(
                f"{out}/bad", meta, {n: t for n, t in state.items() if "/" not in n},
                {n: t for n, t in state.items() if "/" in n}, None,
            )  # fmt: skip
        dist.barrier()
        try:
            load_checkpoint(run, f"{out}/bad")
            refused = None
        except CheckpointError as e:
            refused = str(e)
        result = {
            "numel": sum(p.numel() for p in run.chunks[0].parameters()),
            "own": own,
            "bucket": max(b.grad_data.numel() for b in run.chunks[0].buckets),
            **{f"{name}_held": t.held for name, t in (("train", train), ("save", save))},
            **{name: t.peak for name, t in (("train", train), ("save", save), ("load", load))},
            "exact": exact,
            "refused": refused,
        }
        # Another vocabulary padding (320 rows where 256 were saved): each rank's ranges hold
        # the saved state, zeros past the saved rows.
        ps.destroy_model_parallel()
        run = build_run(
            _config(corpus, out, *MEMORY, "model.make_vocab_size_divisible_by=320"), device
        )
        load_checkpoint(run, ckpt)
        _, full = read_full_state(ckpt, with_optimizer=True, progress=False)
        names = {p: n for n, p in named_params(run.chunks, loading=True).items()}
        result["padded_exact"] = []
        for shard, state in run.optimizer.shard_state():
            for k, value in state.items():
                want = full[f"{names[shard.param]}/{k}"]
                want = torch.cat(
                    [want, want.new_zeros(shard.param.shape[0] - len(want), *want.shape[1:])]
                )
                result["padded_exact"].append(
                    torch.equal(value, want.view(-1)[shard.start : shard.end])
                )
        return result
    finally:
        ps.destroy_model_parallel()


def test_saving_and_loading_hold_no_more_than_own_shard(corpus, tmp_path):
    """At dp 4, bytes allocated on top of what a rank held: a save ~40 kB (RNG states, DCP's
    plans), a training step ~2.1 MB, a load ~3.8 MB (the 3.3 MB of new moments, one saved
    chunk); the gathered per-parameter state of before added ~24 MB to a save, ~23 MB to a
    load.  Also: the state reads back exactly, at another vocabulary padding too, and a
    checkpoint whose state does not fit is refused by every rank."""
    results = run_distributed(_save_and_load_memory, 4, args=(corpus, str(tmp_path)), timeout=300)
    for rank, r in enumerate(results):
        print(f"rank {rank}: {r}")
        assert r["exact"], rank
        # Never more than one bucket of fp32 state on top of what training holds, where
        # gathering every parameter's state would add 12 bytes per parameter.
        assert r["save"] <= 4 * r["bucket"] < 12 * r["numel"], (rank, r)
        assert r["save_held"] + r["save"] <= r["train_held"] + r["train"], (rank, r)
        # Loading makes this rank's moments (8 bytes per element of its shard) and reads one
        # saved chunk at a time.
        assert r["load"] <= 8 * r["own"] + 4 * r["bucket"], (rank, r)
        assert re.search(r"fc1.weight/exp_avg was saved with shape \(1024, 255\)", r["refused"])
        assert r["padded_exact"] and all(r["padded_exact"]), rank


def test_a_kill_between_the_renames_of_a_resave_leaves_the_old_copy(killed_checkpoint, tmp_path):
    """`publish` re-saving iteration N moves the old copy aside before the new one lands; a
    kill in between leaves `latest` naming N with only `.old-N` on disk: it is taken back."""
    from megatrain.checkpoint.files import LATEST, find_checkpoint

    ckpt = tmp_path / "ckpt"
    _copy(killed_checkpoint[0], ckpt)
    name = (ckpt / LATEST).read_text().strip()
    (ckpt / name).rename(ckpt / f".old-{name}")
    assert find_checkpoint(ckpt) == ckpt / name
    assert not (ckpt / f".old-{name}").exists()
