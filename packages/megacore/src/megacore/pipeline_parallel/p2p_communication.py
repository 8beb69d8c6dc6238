"""Point-to-point communication between neighbouring pipeline stages.

One function, `communicate`, posts any mix of Megatron-LM's exchanges (recv_forward,
send_forward, recv_backward, send_backward and the combined forms that post a send and a
receive together, such as send_forward_recv_backward): the schedules' `Comm` steps call it.
Every call posts all its operations in one `torch.distributed.batch_isend_irecv`, so a
combined exchange cannot deadlock whatever the pipeline size.  Activations travel with tag 0
and gradients with tag 1, and operations are posted in one canonical order (activations
before gradients) on every rank: with two stages, where "next" and "prev" are the same peer,
an activation can never be taken for a gradient.

Shapes are agreed in advance (`tensor_shape`); with `variable_seq_lengths=True`
the sender first sends the shape, so each microbatch may have its own.
"""

import torch
import torch.distributed as dist

from megacore import parallel_state

ACTIVATION_TAG = 0
GRADIENT_TAG = 1
_MAX_DIMS = 8


def _encoded_shape(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.dim() > _MAX_DIMS:
        raise ValueError(
            f"pipeline communication: variable_seq_lengths sends shapes of up to {_MAX_DIMS} "
            f"dimensions, got a {tensor.dim()}-dimensional tensor {tuple(tensor.shape)}"
        )
    shape = torch.zeros(_MAX_DIMS + 1, dtype=torch.int64)
    shape[0] = tensor.dim()
    shape[1 : tensor.dim() + 1] = torch.tensor(tensor.shape)
    return shape.to(tensor.device)


def _exchange_shapes(send_next, send_prev, recv_prev, recv_next, device):
    """Send our shapes and receive the peers' before the tensors themselves."""
    group = parallel_state.get_pipeline_model_parallel_group()
    next_rank = parallel_state.get_pipeline_model_parallel_next_rank()
    prev_rank = parallel_state.get_pipeline_model_parallel_prev_rank()

    def buffer():
        return torch.zeros(_MAX_DIMS + 1, dtype=torch.int64, device=device)

    recv_prev_shape = buffer() if recv_prev else None
    recv_next_shape = buffer() if recv_next else None
    ops = []  # the same canonical order as the tensors themselves
    if send_next is not None:
        ops.append(
            dist.P2POp(dist.isend, _encoded_shape(send_next), next_rank, group, ACTIVATION_TAG)
        )
    if recv_prev_shape is not None:
        ops.append(dist.P2POp(dist.irecv, recv_prev_shape, prev_rank, group, ACTIVATION_TAG))
    if send_prev is not None:
        ops.append(
            dist.P2POp(dist.isend, _encoded_shape(send_prev), prev_rank, group, GRADIENT_TAG)
        )
    if recv_next_shape is not None:
        ops.append(dist.P2POp(dist.irecv, recv_next_shape, next_rank, group, GRADIENT_TAG))
    for req in dist.batch_isend_irecv(ops) if ops else []:
        req.wait()

    def decode(buf):
        return None if buf is None else tuple(buf[1 : int(buf[0]) + 1].tolist())

    return decode(recv_prev_shape), decode(recv_next_shape)


def communicate(
    *,
    tensor_send_next: torch.Tensor | None = None,
    tensor_send_prev: torch.Tensor | None = None,
    recv_prev: bool = False,
    recv_next: bool = False,
    tensor_shape=None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
    variable_seq_lengths: bool = False,
    wait: bool = True,
):
    """Post the sends and receives together; return (from_prev, from_next, requests).

    With `wait=False` the requests are returned unfinished: the caller waits on
    them before touching the received tensors or reusing the sent ones.
    A received activation requires grad: it is this stage's input.
    """
    if not (recv_prev or recv_next or tensor_send_next is not None or tensor_send_prev is not None):
        return None, None, []
    group = parallel_state.get_pipeline_model_parallel_group()
    next_rank = parallel_state.get_pipeline_model_parallel_next_rank()
    prev_rank = parallel_state.get_pipeline_model_parallel_prev_rank()
    if device is None:
        sent = tensor_send_next if tensor_send_next is not None else tensor_send_prev
        device = sent.device if sent is not None else _default_device()
    prev_shape = next_shape = tensor_shape
    if variable_seq_lengths:
        prev_shape, next_shape = _exchange_shapes(
            tensor_send_next, tensor_send_prev, recv_prev, recv_next, device
        )
    elif (recv_prev or recv_next) and tensor_shape is None:
        raise ValueError(
            "pipeline communication: pass tensor_shape to receive, "
            "or variable_seq_lengths=True to exchange shapes first"
        )

    from_prev = torch.empty(prev_shape, dtype=dtype, device=device) if recv_prev else None
    from_next = torch.empty(next_shape, dtype=dtype, device=device) if recv_next else None
    ops = []
    if tensor_send_next is not None:
        ops.append(
            dist.P2POp(dist.isend, tensor_send_next.contiguous(), next_rank, group, ACTIVATION_TAG)
        )
    if from_prev is not None:
        ops.append(dist.P2POp(dist.irecv, from_prev, prev_rank, group, ACTIVATION_TAG))
    if tensor_send_prev is not None:
        ops.append(
            dist.P2POp(dist.isend, tensor_send_prev.contiguous(), prev_rank, group, GRADIENT_TAG)
        )
    if from_next is not None:
        ops.append(dist.P2POp(dist.irecv, from_next, next_rank, group, GRADIENT_TAG))
    requests = dist.batch_isend_irecv(ops)
    if wait:
        for req in requests:
            req.wait()
        requests = []
    if from_prev is not None:
        from_prev.requires_grad_(True)  # the input of this stage: backward needs its gradient
    return from_prev, from_next, requests


def _default_device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
