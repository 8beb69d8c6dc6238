"""Model-parallel random numbers (paper Appendix B.2) and activation checkpointing.

One user seed gives two kinds of streams:

- the default generators (CPU, and CUDA when present) are seeded with the same
  seed on every tensor-parallel rank, so dropout outside model-parallel regions
  (on the full hidden state) draws the same mask on every TP rank;
- a tracked state named `model-parallel-rng`, seeded with seed + 2718 + TP rank,
  is entered with `get_rng_tracker().fork()` around dropout inside a
  model-parallel region (attention probabilities of the local heads), so each
  rank draws its own mask.

The tracker swaps the CPU generator and, when CUDA is available, the current
device's generator, so the same code is right on CPU (gloo) and GPU.
`checkpoint` saves and restores all of these so the recomputed forward draws
exactly the masks the first forward drew.  A fork inside a fork of the same state changes
nothing, so a caller may fork once around a block whose draws are all per rank (a layer
under sequence parallelism) and the forks inside it cost no generator swaps; a checkpoint
taken inside such a fork recomputes inside it too.  Megatron's names
(`get_cuda_rng_tracker`, `model_parallel_cuda_manual_seed`) are kept as aliases.
"""

import contextlib

import torch
import torch.distributed as dist

from megacore import parallel_state

_MODEL_PARALLEL_RNG = "model-parallel-rng"
# Offsets the TP stream away from the default stream seeded with the same user seed.
_TP_SEED_OFFSET = 2718


def _cuda() -> bool:
    return torch.cuda.is_available()


def _get_states() -> tuple[torch.Tensor, torch.Tensor | None]:
    return torch.get_rng_state(), torch.cuda.get_rng_state() if _cuda() else None


def _set_states(states: tuple[torch.Tensor, torch.Tensor | None]) -> None:
    cpu, cuda = states
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda)


def _seeded_states(seed: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The generator states that `seed` gives, leaving the current states as they were."""
    saved = _get_states()
    torch.manual_seed(seed)  # seeds CPU and every CUDA device
    states = _get_states()
    _set_states(saved)
    return states


class RNGStatesTracker:
    """Named generator states that `fork` swaps in for the duration of a block."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.states_: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {}
        self.seeds_: set[int] = set()
        self.active: str | None = None  # the state the generators draw from now (fork)

    def get_states(self) -> dict:
        return dict(self.states_)

    def set_states(self, states: dict) -> None:
        self.states_ = dict(states)

    def add(self, name: str, seed: int) -> None:
        if seed in self.seeds_:
            raise ValueError(f"RNG tracker: seed {seed} already used by another state")
        if name in self.states_:
            raise ValueError(f"RNG tracker: state {name!r} already exists")
        self.seeds_.add(seed)
        self.states_[name] = _seeded_states(seed)

    def fork(self, name: str = _MODEL_PARALLEL_RNG):
        """A block drawing from state `name`.  Inside a fork of the same state (a caller that
        forked around a whole layer) it changes nothing: a plain nullcontext, which
        torch.compile traces, where a generator swap would cut the graph."""
        if name not in self.states_:
            raise RuntimeError(
                f"RNG tracker: no state {name!r}; call "
                "megacore.tensor_parallel.model_parallel_manual_seed(seed) first"
            )
        if self.active == name:
            return contextlib.nullcontext()
        return self._swapped(name)

    @contextlib.contextmanager
    def _swapped(self, name: str):
        outside, outside_active = _get_states(), self.active
        _set_states(self.states_[name])
        self.active = name
        try:
            yield
        finally:
            self.states_[name] = _get_states()
            _set_states(outside)
            self.active = outside_active


_TRACKER = RNGStatesTracker()


def get_rng_tracker() -> RNGStatesTracker:
    return _TRACKER


def model_parallel_manual_seed(seed: int) -> None:
    """Seed the default generators with `seed` and the TP stream with seed + 2718 + TP rank.

    Call it on every rank after `initialize_model_parallel`.  Pipeline stages that
    should draw different dropout masks pass different seeds (the training loop's choice).
    """
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    torch.manual_seed(seed)
    _TRACKER.reset()
    _TRACKER.add(_MODEL_PARALLEL_RNG, seed + _TP_SEED_OFFSET + tp_rank)


# Megatron-LM's names, for code moving over.
get_cuda_rng_tracker = get_rng_tracker
model_parallel_cuda_manual_seed = model_parallel_manual_seed


def _split_for_rank(t: torch.Tensor) -> torch.Tensor:
    world = parallel_state.get_tensor_model_parallel_world_size()
    rank = parallel_state.get_tensor_model_parallel_rank()
    flat = t.detach().reshape(-1)
    if flat.numel() % world:
        raise ValueError(
            f"checkpoint(distribute_saved_activations=True): input has {flat.numel()} elements, "
            f"not divisible by tensor_model_parallel_size ({world})"
        )
    return flat.chunk(world)[rank].clone()


def _gather_from_ranks(chunk: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    world = parallel_state.get_tensor_model_parallel_world_size()
    out = torch.empty(world * chunk.numel(), dtype=chunk.dtype, device=chunk.device)
    dist.all_gather(
        list(out.chunk(world)), chunk, group=parallel_state.get_tensor_model_parallel_group()
    )
    return out.view(shape)


class CheckpointFunction(torch.autograd.Function):
    """Run `function` without keeping activations; recompute it in backward.

    The generator states (CPU, CUDA, tracker) at the start of the forward are
    saved and restored for the recompute, then the states the rest of training
    has reached are put back.
    """

    @staticmethod
    def forward(ctx, function, distribute_saved_activations, *args):
        ctx.function = function
        ctx.distribute = distribute_saved_activations
        ctx.fwd_states = _get_states()
        ctx.fwd_tracker_states = _TRACKER.get_states()
        ctx.fwd_active = _TRACKER.active  # forked around the call: the recompute is too
        with torch.no_grad():
            outputs = function(*args)
        tensors = [a if torch.is_tensor(a) else None for a in args]
        ctx.inputs = [None if torch.is_tensor(a) else a for a in args]
        ctx.inputs_require_grad = [torch.is_tensor(a) and a.requires_grad for a in args]
        if (
            distribute_saved_activations
            and parallel_state.get_tensor_model_parallel_world_size() > 1
        ):
            # Keep only this rank's 1/tp of the first input (identical on every TP rank).
            ctx.first_shape = tensors[0].shape
            tensors[0] = _split_for_rank(tensors[0])
        else:
            ctx.distribute = False
        ctx.save_for_backward(*(t for t in tensors if t is not None))
        ctx.tensor_slots = [i for i, t in enumerate(tensors) if t is not None]
        return outputs

    @staticmethod
    def backward(ctx, *grads):
        if not torch.autograd._is_checkpoint_valid():
            raise RuntimeError("checkpoint: use .backward(), not torch.autograd.grad()")
        args = list(ctx.inputs)
        saved = list(ctx.saved_tensors)
        if ctx.distribute:
            saved[0] = _gather_from_ranks(saved[0], ctx.first_shape)
        for slot, t in zip(ctx.tensor_slots, saved, strict=True):
            detached = t.detach()
            detached.requires_grad_(ctx.inputs_require_grad[slot])
            args[slot] = detached

        after_states, after_tracker = _get_states(), _TRACKER.get_states()
        after_active = _TRACKER.active
        _set_states(ctx.fwd_states)
        _TRACKER.set_states(ctx.fwd_tracker_states)
        _TRACKER.active = ctx.fwd_active
        try:
            with torch.enable_grad():
                outputs = ctx.function(*args)
        finally:
            _set_states(after_states)
            _TRACKER.set_states(after_tracker)
            _TRACKER.active = after_active

        if torch.is_tensor(outputs):
            outputs = (outputs,)
        pairs = [
            (o, g)
            for o, g in zip(outputs, grads, strict=True)
            if torch.is_tensor(o) and o.requires_grad and g is not None
        ]
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        input_grads = tuple(a.grad if torch.is_tensor(a) else None for a in args)
        return (None, None, *input_grads)


def checkpoint(function, distribute_saved_activations: bool, *args):
    """Activation checkpointing with Megatron's signature: `checkpoint(fn, False, x, ...)`.

    `distribute_saved_activations=True` keeps only 1/tp of the first input on each
    TP rank between forward and backward (that input must be the same on every TP
    rank, as the hidden state between layers is without sequence parallelism).
    """
    return CheckpointFunction.apply(function, distribute_saved_activations, *args)
