"""`emulate_make_graphed_callables`: torch.cuda.make_graphed_callables' contract on any device.

A CPU cannot capture a CUDA graph, but most of what goes wrong around one is not the capture:
it is the static memory.  This double keeps that memory as the real one does and makes its
hazards louder:

- warm-up runs each callable's forward and backward `num_warmup_iters` times through
  `torch.autograd.grad` with NaN output gradients (the real one: uninitialised memory), so a
  side effect of those passes that is not undone (a gradient buffer) poisons training;
- each callable has static inputs (a replay copies the arguments in), static outputs and
  static gradients; a replay overwrites them, so an output or a gradient kept past the next
  replay changes under its holder, as in a graph's memory pool.  The outputs start as NaN
  (a capture runs no kernel);
- the activations of a forward replay are the graph's own: the next forward replay replaces
  them, so a backward after a second forward sees the second microbatch's, as a real graph
  would;
- a parameter whose gradient the captured backward does not make (unused) gets None for good;
- arguments must be tensors in the sample's structure, module hooks are refused, and a
  module whose training flag differs from the capture's runs its own forward.

What it cannot show: a replay here runs the callable's Python again, where a real replay
runs only the captured kernels.  Code that must run on every pass (a Python callback inside
the layer) therefore works here and not on a GPU; keep such code outside the graphed
callable and check it with a side effect a replay cannot make (see `megatrain.parallelize.
apply_cuda_graphs`).  The GPU check runs the real capture.
"""

import torch
from torch.utils._pytree import arg_tree_leaves, tree_flatten, tree_unflatten


def _check_module(c) -> None:
    if isinstance(c, torch.nn.Module):
        if c._backward_hooks or c._forward_hooks or c._forward_pre_hooks:
            raise AssertionError("Modules must not have hooks registered when they are passed")
        if any(b.requires_grad for b in c.buffers()):
            raise AssertionError("only parameters may be trainable; buffers must not require grad")


class _Replayer:
    def __init__(self, func, sample_args, allow_unused: bool):
        # A module's forward as it is now: the module's own call will soon be the graphed one.
        self.func = func.forward if isinstance(func, torch.nn.Module) else func
        self.params = tuple(func.parameters()) if isinstance(func, torch.nn.Module) else ()
        self.inputs = tuple(arg_tree_leaves(*sample_args))
        if not all(isinstance(a, torch.Tensor) for a in self.inputs):
            raise AssertionError("sample_args must contain only Tensors")
        self.surface = self.inputs + self.params
        self.inputs_structure = sample_args  # the static inputs, in the callable's structure
        self.allow_unused = allow_unused
        self.live = None  # the outputs of the last forward replay, with their autograd graph
        self.outputs = self.spec = self.grad_outputs = self.grad_inputs = None

    def _grad(self, outputs, grad_outputs):
        wanted = [o for o in outputs if o.requires_grad]
        if not wanted:
            return None
        return torch.autograd.grad(
            wanted,
            [i for i in self.surface if i.requires_grad],
            grad_outputs,
            allow_unused=self.allow_unused,
            retain_graph=True,  # a graph's backward can be replayed again
        )

    def warm_up(self, iters: int) -> None:
        for _ in range(iters):
            outputs = tree_flatten(self.func(*self.inputs_structure))[0]
            nan = [torch.full_like(o, float("nan")) for o in outputs if o.requires_grad]
            self._grad(outputs, nan)

    def capture(self) -> None:
        flat, self.spec = tree_flatten(self.func(*self.inputs_structure))
        self.outputs = tuple(torch.full_like(o.detach(), float("nan")) for o in flat)
        self.output_requires_grad = [o.requires_grad for o in flat]
        self.grad_outputs = tuple(
            torch.full_like(o, float("nan")) if g else None
            for o, g in zip(self.outputs, self.output_requires_grad, strict=True)
        )

    def forward(self, *inputs):
        for static, given in zip(self.inputs, inputs, strict=True):
            if static.data_ptr() != given.data_ptr():
                with torch.no_grad():
                    static.copy_(given)
        with torch.enable_grad():
            self.live = tree_flatten(self.func(*self.inputs_structure))[0]
        with torch.no_grad():
            for static, live in zip(self.outputs, self.live, strict=True):
                static.copy_(live)
        return tuple(o.detach() for o in self.outputs)

    def backward(self, *grads):
        for static, g in zip(self.grad_outputs, grads, strict=True):
            if static is not None and static.data_ptr() != g.data_ptr():
                static.copy_(g)
        wanted = [g for g in self.grad_outputs if g is not None]
        made = self._grad(self.live, wanted)
        made = iter(made or ())
        fresh = [next(made) if i.requires_grad else None for i in self.surface]
        if self.grad_inputs is None:  # the buffers the "capture" allocated, kept for good
            self.grad_inputs = [None if g is None else torch.empty_like(g) for g in fresh]
        out = []
        for static, g in zip(self.grad_inputs, fresh, strict=True):
            if static is None:
                out.append(None)
                continue
            static.copy_(g)
            out.append(static.detach())
        return tuple(out)


def _graphed_function(replayer: _Replayer):
    class Graphed(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *inputs):
            return replayer.forward(*inputs[: len(replayer.inputs)])

        @staticmethod
        @torch.autograd.function.once_differentiable
        def backward(ctx, *grads):
            return replayer.backward(*grads)

    def functionalized(*user_args):
        flat = tuple(arg_tree_leaves(*user_args))
        if len(flat) != len(replayer.inputs) or not all(isinstance(a, torch.Tensor) for a in flat):
            raise TypeError(
                f"a graphed callable takes its sample's {len(replayer.inputs)} tensor(s), "
                f"got {len(flat)} leaves: {[type(a).__name__ for a in flat]}"
            )
        out = Graphed.apply(*(flat + replayer.params))
        return tree_unflatten(list(out), replayer.spec)

    return functionalized


def emulate_make_graphed_callables(
    callables, sample_args, num_warmup_iters: int = 3, allow_unused_input: bool = False, pool=None
):
    """torch.cuda.make_graphed_callables' signature and contract (module doc), on any device."""
    single = not isinstance(callables, tuple)
    if single:
        callables, sample_args = (callables,), (sample_args,)
    replayers = []
    for c, args in zip(callables, sample_args, strict=True):
        _check_module(c)
        replayers.append(_Replayer(c, args, allow_unused_input))
    for r in replayers:
        r.warm_up(num_warmup_iters)
    for r in replayers:
        r.capture()
    out = []
    for c, r in zip(callables, replayers, strict=True):
        graphed = _graphed_function(r)
        if isinstance(c, torch.nn.Module):
            c.forward = _forward_by_mode(c, c.training, graphed, c.forward)
            out.append(c)
        else:
            out.append(graphed)
    return out[0] if single else tuple(out)


def _forward_by_mode(module, graphed_training: bool, graphed, original):
    def forward(*args, **kwargs):
        if module.training == graphed_training:
            return graphed(*args, **kwargs)
        return original(*args, **kwargs)

    return forward
