"""The linear layers' weight gradients, computed in the backward or deferred to a later step.

Zero-bubble pipeline schedules split a backward in two: the input gradient (B),
which the previous stage waits for, and the weight gradients (W), which no one
waits for and can fill the schedule's idle time.  Every weight matrix of a
megacore model is used through `linear`, so the split needs nothing of the
model:

- Inside `split_backward()` (forward and backward of a split step), `linear`
  records what it needs for the weight gradient: its input and the weight.
- Inside `deferring_weight_grads()` (the B step) a linear's backward returns
  the input gradient (and the bias gradient, a cheap sum) and keeps
  (weight, input, output gradient) in the list the context yields, instead of
  computing the weight gradient.
- `apply_weight_grads(pending)` (the W step) computes those weight gradients,
  sums them per weight, and hands each weight its sum through autograd, so
  `param.grad` accumulates and post-accumulate hooks (the data-parallel
  gradient buffers) fire exactly as in a plain backward.

Outside both contexts `linear` is `torch.nn.functional.linear`: the plain path
is untouched, except for a layer's own weight (`accumulate=True`) that the
data-parallel wrapper marked for gradient-accumulation fusion
(`main_grad_written` set): its backward adds the weight gradient straight into
`main_grad` (one GEMM with beta 1; no `param.grad`, no separate add pass) and
calls `main_grad_written(param)` where the gradient hook would have run.  Only a
layer's own weight: a weight also used elsewhere (tied embeddings) gets its
other gradient through autograd, after the bucket may have been reduced.  Under
`split_backward()` the deferral wins (W hands its sums in through autograd).

Recompute works: a checkpointed layer re-runs its forward inside the B step,
where `split_backward()` is on again.  The deferred tensors (each linear's input
and output gradient) are what a zero-bubble schedule holds between B and W.
"""

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from megacore.tensor_parallel.float8 import Float8Recipe

_split = [False]  # inside split_backward(): linears record for deferral
_pending: list[list | None] = [None]  # inside deferring_weight_grads(): where they go


@contextlib.contextmanager
def split_backward() -> Iterator[None]:
    """Linears called inside can have their weight gradients deferred."""
    previous, _split[0] = _split[0], True
    try:
        yield
    finally:
        _split[0] = previous


@contextlib.contextmanager
def deferring_weight_grads() -> Iterator[list]:
    """Backwards inside keep the weight gradients of linears built under `split_backward()`
    in the yielded list (for `apply_weight_grads`) instead of computing them."""
    pending: list = []
    previous, _pending[0] = _pending[0], pending
    try:
        yield pending
    finally:
        _pending[0] = previous


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    accumulate: bool = False,
    float8: Float8Recipe | None = None,
):
    """x A^T + b, as `F.linear`; under `split_backward()` its weight gradient can be deferred.
    `accumulate`: `weight` is the caller's own parameter, used nowhere else in the step, so
    its gradient may go straight into `main_grad` (module doc).  `float8`: the GEMMs in float8
    (`tensor_parallel.float8`; not combined with deferral or fusion, which megatrain refuses)."""
    if float8 is not None and float8.applies_to(weight):
        return float8.linear(x, weight, bias)
    weight_in, held = weight_grad_route(weight, accumulate)
    if held is None:
        return F.linear(x, weight, bias)
    return _Linear.apply(x, weight_in, bias, held)


def weight_grad_route(
    weight: torch.Tensor, accumulate: bool
) -> tuple[torch.Tensor, "_Weight | None"]:
    """(the weight as a custom backward takes it, what takes its gradient's operands): the
    weight itself and None where autograd takes the gradient as usual; else the weight
    detached and a `_Weight` whose `take(weight, x, grad)` defers the gradient (inside
    `split_backward()`) or adds it into `main_grad` (gradient-accumulation fusion)."""
    if not torch.is_grad_enabled() or not weight.requires_grad:
        return weight, None
    if not _split[0]:
        if accumulate and getattr(weight, "main_grad_written", None) is not None:
            return weight.detach(), _Weight(weight, _into_main_grad)
        return weight, None
    # The weight enters detached: a backward never reaches it (its gradient hooks would fire
    # with no gradient); its gradient goes in through autograd from `apply_weight_grads`.
    return weight.detach(), _Weight(weight, _defer)


def take_weight_grad(held, needed: bool, x: torch.Tensor, grad: torch.Tensor):
    """A custom backward's weight gradient for `x` and the output gradient `grad`: handed to
    `held` (`weight_grad_route`) and None, else computed and returned when `needed`."""
    if held is not None:
        held.take(held.tensor, x, grad)
        return None
    return _weight_grad(x, grad) if needed else None


class _Weight:
    """The weight as the model holds it (a parameter, or a cast of one), out of autograd's
    view, and what its backward does with the weight gradient's operands (`take`)."""

    def __init__(self, tensor: torch.Tensor, take):
        self.tensor, self.take = tensor, take


def _weight_grad(x: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    return grad.reshape(-1, grad.shape[-1]).t().matmul(x.reshape(-1, x.shape[-1]))


class _Linear(torch.autograd.Function):
    """F.linear whose backward returns the input and bias gradients and hands the weight
    gradient's operands to `held.take(weight, x, grad)` instead of returning it."""

    @staticmethod
    def forward(ctx, x, weight, bias, held: _Weight):
        ctx.save_for_backward(x, weight)
        ctx.held, ctx.has_bias = held, bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        needs_x, _, needs_bias, _ = ctx.needs_input_grad
        grad_x = grad.matmul(weight) if needs_x else None
        grad_bias = grad.reshape(-1, grad.shape[-1]).sum(0) if ctx.has_bias and needs_bias else None
        ctx.held.take(ctx.held.tensor, x, grad)
        return grad_x, None, grad_bias, None


def _defer(weight: torch.Tensor, x: torch.Tensor, grad: torch.Tensor) -> None:
    if _pending[0] is not None:
        _pending[0].append((weight, x, grad))
    else:  # split_backward() without deferral: the weight gradient now
        apply_weight_grads([(weight, x, grad)])


def _into_main_grad(param: torch.Tensor, x: torch.Tensor, grad: torch.Tensor) -> None:
    grad, x = grad.reshape(-1, grad.shape[-1]), x.reshape(-1, x.shape[-1])
    accumulate_gemm(param.main_grad, grad.t(), x)
    param.main_grad_written(param)


_mixed_dtype_addmm = {}  # device type -> whether addmm(out_dtype=) runs there


def accumulate_gemm(main_grad: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """main_grad += a @ b in one GEMM; bf16/fp16 operands into an fp32 main_grad (or any fp32
    sum) through addmm's out_dtype where the device has it (CUDA), else a GEMM and an add."""
    if a.dtype == main_grad.dtype:
        main_grad.addmm_(a, b)
        return
    device = main_grad.device.type
    if _mixed_dtype_addmm.get(device, True):
        try:
            torch.addmm(main_grad, a, b, out_dtype=main_grad.dtype, out=main_grad)
            _mixed_dtype_addmm[device] = True
            return
        except (RuntimeError, TypeError, NotImplementedError):
            _mixed_dtype_addmm[device] = False  # not on this device or torch: the two-pass way
    main_grad.add_(a @ b)


def apply_weight_grads(pending: list) -> None:
    """Compute the deferred weight gradients and accumulate them (module doc)."""
    sums: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for weight, x, grad in pending:
        g = _weight_grad(x, grad)
        if id(weight) in sums:
            g = sums[id(weight)][1] + g
        sums[id(weight)] = (weight, g)
    pending.clear()
    if sums:
        weights, grads = zip(*sums.values(), strict=True)
        torch.autograd.backward(list(weights), list(grads))
