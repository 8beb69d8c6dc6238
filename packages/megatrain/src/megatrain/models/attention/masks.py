"""Which keys a query sees: packed documents' and sliding windows' masks, as an s x s boolean for
SDPA on the CPU and as FlexAttention's block mask on CUDA (blocks no query may see are skipped,
so a window's work grows with s·window, not s²).

A window of w: a causal query at i sees keys i - w < j <= i (itself and the w - 1 before it,
HF's `sliding_window`), within its own document when documents are packed.
"""

from functools import lru_cache

import torch


def document_mask(segments: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """[b, 1, s, s] boolean: query i sees key j when j <= i in the same document (and
    i - j < window)."""
    s = segments.shape[1]
    causal = causal_mask(s, window, segments.device)
    return causal & (segments[:, None, :, None] == segments[:, None, None, :])


def causal_mask(s: int, window: int | None, device, offset: int = 0, keys: int | None = None):
    """[1, 1, s, keys] boolean: query i (at position offset + i) sees key j when j <= offset + i
    and, with a window, offset + i - j < window.  `keys`: default offset + s."""
    q = torch.arange(offset, offset + s, device=device)[:, None]
    k = torch.arange(offset + s if keys is None else keys, device=device)[None, :]
    mask = k <= q
    if window is not None:
        mask = mask & (q - k < window)
    return mask[None, None]


@lru_cache(maxsize=4)
def _flex_attention(compiled: bool):
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False) if compiled else flex_attention


def attention_block_mask(segments: torch.Tensor | None, window: int | None, b: int, s: int, device):
    """FlexAttention's block mask for causal attention within the documents of `segments`
    (None: one sequence), with an optional sliding window."""
    from torch.nn.attention.flex_attention import create_block_mask

    def visible(b, h, q_idx, kv_idx):
        seen = kv_idx <= q_idx
        if window is not None:
            seen = seen & (q_idx - kv_idx < window)
        if segments is not None:
            seen = seen & (segments[b, q_idx] == segments[b, kv_idx])
        return seen

    return create_block_mask(visible, b if segments is not None else None, None, s, s,
                             device=device)  # fmt: skip


def document_block_mask(segments: torch.Tensor, window: int | None = None):
    """FlexAttention's block mask for causal attention within the documents of `segments`."""
    b, s = segments.shape
    return attention_block_mask(segments, window, b, s, segments.device)


def flex_attention(q, k, v, block, compiled: bool = True, return_lse: bool = False):
    """Attention by FlexAttention's block mask `block`: blocks of keys no query of a block
    may see are skipped, never an s x s mask.  `compiled=False` runs FlexAttention's eager
    reference (any device, slow: for tests).  `return_lse`: also the log-sum-exp (sinks)."""
    gqa = {"enable_gqa": True} if k.shape[1] != q.shape[1] else {}
    return _flex_attention(compiled)(q, k, v, block_mask=block, return_lse=return_lse, **gqa)


def flex_document_attention(q, k, v, segments: torch.Tensor, compiled: bool = True, block=None):
    """Causal attention within documents by FlexAttention's block mask (`block`, else made
    from `segments`)."""
    block = document_block_mask(segments) if block is None else block
    return flex_attention(q, k, v, block, compiled)
