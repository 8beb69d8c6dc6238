"""Attention sinks over a fused kernel that returns the log-sum-exp, against the sink softmax
computed as HF's gpt-oss eager path does (one more score column, dropped after softmax)."""

import itertools

import torch

from megacore import attention_kernels


def _sink_reference(q, k, v, mask, sinks):
    b, heads, _, d = q.shape
    k, v = (t.repeat_interleave(heads // t.size(1), dim=1) for t in (k, v))
    scores = (q @ k.transpose(-1, -2)) * d**-0.5
    scores = scores.masked_fill(~mask, float("-inf"))
    column = sinks.reshape(1, heads, 1, 1).expand(b, heads, scores.size(2), 1)
    return torch.softmax(torch.cat([scores, column], -1), -1)[..., :-1] @ v


def test_sinks_on_the_fused_kernel_and_without_it_equal_the_sink_softmax():
    """Output and the q, k, v and sink gradients, causal and masked (a window within packed
    documents), grouped K/V too, by the CPU flash kernel (float64 and bfloat16) and by the
    float32 ops used where no kernel fits; a zero sink is not plain attention (the sink
    changes the result, so the comparison can fail)."""
    g = torch.Generator().manual_seed(0)
    b, heads, s, d = 2, 4, 24, 16
    pos = torch.arange(s)
    documents = (pos >= 10).long() + (pos >= 17).long()
    window = (pos[None, :] <= pos[:, None]) & (pos[:, None] - pos[None, :] < 5)
    masked = (window & (documents[:, None] == documents[None, :]))[None, None]
    causal = (pos[None, :] <= pos[:, None])[None, None]
    for groups, (mask, is_causal), dtype in itertools.product(
        (4, 2), ((masked, False), (None, True)), (torch.float64, torch.bfloat16)
    ):
        q = torch.randn(b, heads, s, d, generator=g, dtype=torch.float64)
        k, v = (torch.randn(b, groups, s, d, generator=g, dtype=torch.float64) for _ in range(2))
        sinks = torch.randn(heads, generator=g, dtype=torch.float64)
        upstream = torch.randn(b, heads, s, d, generator=g, dtype=torch.float64)
        ref_inputs = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
        ref = _sink_reference(*ref_inputs[:3], masked if mask is not None else causal,
                              ref_inputs[3])  # fmt: skip
        ref.backward(upstream)
        for kernel in (True, False):
            inputs = [t.to(dtype).clone().requires_grad_() for t in (q, k, v)]
            sink = sinks.clone().requires_grad_()
            real = attention_kernels.fused_kernel
            if not kernel:  # as on a device or dtype no kernel takes
                attention_kernels.fused_kernel = lambda *a, **kw: None
            try:
                out = attention_kernels.attention_with_sinks(
                    *inputs, sink, mask=mask, causal=is_causal
                )
            finally:
                attention_kernels.fused_kernel = real
            out.backward(upstream.to(dtype))
            tol = 1e-9 if dtype == torch.float64 else 3e-2
            got = [out, *(t.grad for t in inputs), sink.grad]
            want = [ref, *(t.grad for t in ref_inputs)]
            for name, x, y in zip(("out", "dq", "dk", "dv", "dsinks"), got, want, strict=True):
                assert x.dtype == dtype or name == "dsinks"
                err = (x.double() - y).abs().max().item()
                scale = y.abs().max().item()
                assert err <= tol * max(1.0, scale), (groups, is_causal, dtype, kernel, name, err)
    plain = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                             enable_gqa=True)  # fmt: skip
    zero = attention_kernels.attention_with_sinks(q, k, v, torch.zeros(heads,
                                                  dtype=torch.float64), causal=True)  # fmt: skip
    assert (zero - plain).abs().max() > 1e-3
