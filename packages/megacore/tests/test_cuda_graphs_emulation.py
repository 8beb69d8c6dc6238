"""megacore.testing.emulate_make_graphed_callables keeps torch.cuda.make_graphed_callables'
contract.  Where CUDA is present every contract check also runs against the real function,
so the double cannot drift from what it stands in for; the loudness it adds (NaN warm-up
gradients) is checked on the double alone."""

import pytest
import torch
from torch import nn

from megacore.testing import emulate_make_graphed_callables

MAKERS = [pytest.param(emulate_make_graphed_callables, "cpu", id="emulated")]
if torch.cuda.is_available():
    MAKERS.append(pytest.param(torch.cuda.make_graphed_callables, "cuda", id="cuda"))


def _mlp(device: str, unused: bool = False) -> nn.Module:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8)).to(device)
    if unused:
        m.register_parameter("unused", nn.Parameter(torch.ones(3, device=device)))
    return m


def _x(device: str, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(4, 8, generator=g).to(device).requires_grad_()


def _eager_grads(device: str, x: torch.Tensor, grad: torch.Tensor) -> tuple:
    m = _mlp(device)
    x = x.detach().requires_grad_()
    m(x).backward(grad)
    return x.grad, [p.grad for p in m.parameters()]


@pytest.mark.parametrize(("make", "device"), MAKERS)
def test_a_graphed_module_computes_what_the_module_does(make, device):
    model = make(_mlp(device), (_x(device, 0),))
    reference = _mlp(device)
    for seed in (1, 2):
        x = _x(device, seed)
        grad = torch.ones(4, 8, device=device) * seed
        out = model(x)
        torch.testing.assert_close(out, reference(x))
        for p in model.parameters():
            p.grad = None
        out.backward(grad)
        x_grad, param_grads = _eager_grads(device, x, grad)
        torch.testing.assert_close(x.grad, x_grad)
        for p, want in zip(model.parameters(), param_grads, strict=True):
            torch.testing.assert_close(p.grad, want)


@pytest.mark.parametrize(("make", "device"), MAKERS)
def test_outputs_and_activations_belong_to_the_graph(make, device):
    """An output kept past the next replay changes under its holder, and a backward after a
    second forward takes the second's activations: the hazards of static memory."""
    model = make(_mlp(device), (_x(device, 0),))
    x1, x2 = _x(device, 1), _x(device, 2)
    y1 = model(x1)
    kept = y1.detach().clone()
    y2 = model(x2)
    torch.testing.assert_close(y1, y2)  # the same memory
    assert not torch.equal(y1, kept)
    grad = torch.ones(4, 8, device=device)
    for p in model.parameters():
        p.grad = None
    y1.backward(grad)
    _, at_x2 = _eager_grads(device, x2, grad)
    for p, want in zip(model.parameters(), at_x2, strict=True):
        torch.testing.assert_close(p.grad, want)


@pytest.mark.parametrize(("make", "device"), MAKERS)
def test_an_unused_parameter_gets_no_gradient_but_its_hook_runs(make, device):
    model = make(_mlp(device, unused=True), (_x(device, 0),), allow_unused_input=True)
    seen = []
    model.unused.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad))
    model(_x(device, 1)).sum().backward()
    assert model.unused.grad is None and seen == [None]
    assert model[0].weight.grad is not None


@pytest.mark.parametrize(("make", "device"), MAKERS)
def test_eval_mode_runs_the_module_own_forward(make, device):
    model = make(nn.Sequential(_mlp(device), nn.Dropout(0.5)), (_x(device, 0),))
    model.eval()
    x = _x(device, 1)
    torch.testing.assert_close(model(x), model[0](x))  # no dropout: not the training graph


def test_the_warm_up_gradients_are_nan():
    """A side effect of the warm-up's backward that is not undone poisons what it touched."""
    touched = torch.zeros(8)

    class Record(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            touched.add_(grad.sum(0))
            return grad

    class Module(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(8, 8)

        def forward(self, x):
            return Record.apply(self.linear(x))

    emulate_make_graphed_callables(Module(), (_x("cpu", 0),))
    assert touched.isnan().all()


def test_module_hooks_and_non_tensor_arguments_are_refused():
    hooked = _mlp("cpu")
    hooked.register_forward_hook(lambda *args: None)
    with pytest.raises(AssertionError, match="hooks"):
        emulate_make_graphed_callables(hooked, (_x("cpu", 0),))
    model = emulate_make_graphed_callables(_mlp("cpu"), (_x("cpu", 0),))
    with pytest.raises(TypeError, match="takes its sample's 1 tensor"):
        model(_x("cpu", 1), None)
