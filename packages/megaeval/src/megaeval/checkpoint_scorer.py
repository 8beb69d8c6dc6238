"""Scoring with a megatrain checkpoint, forward only, split over tp x cp x pp worker processes.

Every worker loads its part of the model (any layout loads any checkpoint) and
runs the same evaluation function with the same inputs; `score` is collective.
A batch goes through megacore's pipeline schedule (forward only); the last
stage computes each target's loss with the vocabulary-parallel cross entropy
and whether the argmax over the whole vocabulary is the target (each TP rank
offers the best of its slice), and broadcasts both to the other stages, so
every rank returns the same numbers and rank 0 reports them.  With context
parallelism (`--cp`) each sequence is padded on the right to a multiple of 2 x cp
(a causal model never looks at the padding), each CP rank scores its two chunks
of it, and the scores are summed over the CP group into the whole sequence's.
"""

from pathlib import Path

import torch
import torch.distributed as dist

from megacore import parallel_state as ps
from megacore import pipeline_parallel as pipe
from megacore import tensor_parallel as tp
from megacore.context_parallel import cp_chunk_indices
from megaeval.scoring import TokenScores
from megatrain.config import CAUSAL_KINDS
from megatrain.parallelize import apply_context_parallel, split_batch_for_context_parallel


def _global_argmax(local_logits: torch.Tensor) -> torch.Tensor:
    """Vocabulary id of the largest logit over all TP slices [s, b, v/tp] -> [s, b]; ties go
    to the smallest id, as torch.argmax over the whole vocabulary would."""
    best, index = local_logits.max(dim=-1)
    index = index + ps.get_tensor_model_parallel_rank() * local_logits.shape[-1]
    world = ps.get_tensor_model_parallel_world_size()
    if world == 1:
        return index
    group = ps.get_tensor_model_parallel_group()
    bests, indices = (
        [torch.empty_like(best) for _ in range(world)],
        [torch.empty_like(index) for _ in range(world)],
    )
    dist.all_gather(bests, best.contiguous(), group=group)
    dist.all_gather(indices, index.contiguous(), group=group)
    winner = torch.stack(bests).argmax(dim=0)  # the first rank holding the maximum
    return torch.stack(indices).gather(0, winner.unsqueeze(0)).squeeze(0)


class CheckpointScorer:
    """The `megaeval.scoring.Scorer` of a megatrain checkpoint on this rank's tp x cp x pp part."""

    def __init__(self, loaded):
        self.loaded = loaded
        self.model = loaded.chunks[0]
        # Under context parallelism, forward only: all-gather the keys and values (the ring's
        # overlap pays in training).
        apply_context_parallel(self.model, "allgather")
        self.max_seq_len = loaded.config.max_position_embeddings
        self.is_main = dist.get_rank() == 0

    def encode(self, text: str) -> list[int]:
        return self.loaded.tokenizer.encode(text).ids

    @torch.no_grad()
    def score(self, seqs: list[list[int]]) -> list[TokenScores]:
        if any(len(s) < 2 for s in seqs):
            raise ValueError("CheckpointScorer.score: every sequence needs at least 2 tokens")
        length = max(len(s) for s in seqs) - 1
        if length > self.max_seq_len:
            raise ValueError(
                f"a sequence of {length} inputs exceeds the model's {self.max_seq_len}"
            )
        device = self.loaded.device
        cp, cp_rank = ps.get_context_parallel_world_size(), ps.get_context_parallel_rank()
        padded_len = -(-length // (2 * cp)) * 2 * cp
        if padded_len > self.max_seq_len:
            raise ValueError(
                f"--cp {cp} pads a sequence of {length} inputs to {padded_len}, a multiple of "
                f"2 x cp, past the model's {self.max_seq_len} positions; use a --seq-len "
                f"divisible by {2 * cp}"
            )
        padded = torch.zeros(len(seqs), padded_len + 1, dtype=torch.long)
        for i, s in enumerate(seqs):  # right padding: a causal model never looks at it
            padded[i, : len(s)] = torch.tensor(s)
        tokens, labels = padded[:, :-1].to(device), padded[:, 1:].to(device)
        nll = torch.zeros(padded_len, len(seqs), dtype=torch.float64, device=device)
        correct = torch.zeros(padded_len, len(seqs), dtype=torch.uint8, device=device)
        batch = {"tokens": tokens, "labels": labels}
        if cp > 1:  # this rank's chunks, and where they sit in the sequence
            batch = split_batch_for_context_parallel(batch, cp_rank, cp)
        positions = cp_chunk_indices(padded_len, cp_rank, cp).to(device)

        def forward_step(data_iterator, model):
            b = next(data_iterator)
            extra = {"position_ids": b["position_ids"]} if "position_ids" in b else {}
            output = model(b["tokens"], **extra)

            def loss_func(logits):
                if not ps.is_pipeline_last_stage():
                    return logits, {}
                labels_sb = b["labels"].t().contiguous()
                nll[positions] = tp.vocab_parallel_cross_entropy(logits.float(), labels_sb).double()
                correct[positions] = (_global_argmax(logits) == labels_sb).to(torch.uint8)
                return logits.new_zeros(()), {}

            return output, loss_func

        pipe.get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter([batch]),
            model=self.model,
            num_microbatches=1,
            seq_length=padded_len // cp,
            micro_batch_size=len(seqs),
            hidden_size=self.loaded.config.hidden_size,
            dtype=next(self.model.parameters()).dtype,
            sequence_parallel=False,
            forward_only=True,
        )
        if ps.get_pipeline_model_parallel_world_size() > 1:
            group, src = (
                ps.get_pipeline_model_parallel_group(),
                ps.get_pipeline_model_parallel_last_rank(),
            )
            dist.broadcast(nll, src, group=group)
            dist.broadcast(correct, src, group=group)
        if cp > 1:  # each position was scored on one CP rank, zeros elsewhere
            group = ps.get_context_parallel_group()
            dist.all_reduce(nll, group=group)
            dist.all_reduce(correct, group=group)
        nll_np, correct_np = nll.cpu().numpy(), correct.cpu().numpy().astype(bool)
        return [
            TokenScores(
                nll=nll_np[: len(s) - 1, i].copy(), correct=correct_np[: len(s) - 1, i].copy()
            )
            for i, s in enumerate(seqs)
        ]


def _tasks():
    from megaeval.lambada import evaluate_lambada
    from megaeval.wikitext import evaluate_wikitext

    return {"wikitext103": evaluate_wikitext, "lambada": evaluate_lambada}


def _worker(
    task: str, ckpt: str, tp_size: int, pp_size: int, kwargs: dict, cp_size: int = 1
) -> dict | None:
    from megatrain.inference.load import load_model
    from megatrain.run.distributed import init_distributed

    device, _ = init_distributed()
    if device.type == "cpu":
        import os

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // (tp_size * cp_size * pp_size)))
    ps.initialize_model_parallel(tp_size, pp_size, context_parallel_size=cp_size)
    scorer = CheckpointScorer(load_model(ckpt, device, kind=CAUSAL_KINDS))
    if not scorer.is_main:
        kwargs = {**kwargs, "progress": False}
    result = _tasks()[task](scorer, **kwargs)
    result["model"] = {
        "ckpt": str(Path(ckpt).resolve()),
        "iteration": scorer.loaded.meta["iteration"],
        "tensor_model_parallel_size": tp_size,
        "pipeline_model_parallel_size": pp_size,
        "context_parallel_size": cp_size,
    }
    return result if scorer.is_main else None


def evaluate_checkpoint(
    task: str, ckpt: str, tp: int = 1, pp: int = 1, cp: int = 1, **kwargs
) -> dict:
    """Run evaluation `task` (wikitext103 | lambada) on the checkpoint at tp x cp x pp workers
    (cp: each sequence split over that many ranks).

    The checkpoint, its tokenizer and the layout are checked here, before any worker starts.
    """
    from megaeval.errors import EvalDataError, EvalSettingsError
    from megaeval.wikitext import check_window_settings
    from megatrain.checkpoint.files import CheckpointError, find_checkpoint, read_meta
    from megatrain.inference.load import check_layout, load_tokenizer, require_kind
    from megatrain.run import launch

    if task not in _tasks():
        raise ValueError(f"unknown task {task!r}: expected one of {sorted(_tasks())}")
    try:
        directory = find_checkpoint(ckpt)
        meta = read_meta(directory)
        require_kind(meta, CAUSAL_KINDS, f"megaeval {task}", directory)
        load_tokenizer(directory, meta)
    except CheckpointError as e:
        raise EvalDataError(f"--ckpt: {e}") from e
    try:
        check_layout(meta, tp, pp, directory)
    except CheckpointError as e:
        raise EvalSettingsError(str(e)) from e
    if task == "wikitext103":
        check_window_settings(
            kwargs.get("seq_len", 1024),
            kwargs.get("stride", 32),
            meta["model"]["max_position_embeddings"],
        )
    return launch.run_workers(_worker, (task, str(ckpt), tp, pp, kwargs, cp), tp * cp * pp)[0]
