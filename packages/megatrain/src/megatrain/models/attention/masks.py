"""Which keys a query sees: packed documents' masks, as an s x s boolean for SDPA on the CPU and
as FlexAttention's block mask on CUDA (blocks no query may see are skipped).  The place for
sliding windows' masks when they come."""

from functools import lru_cache

import torch


def document_mask(segments: torch.Tensor) -> torch.Tensor:
    """[b, 1, s, s] boolean: query i sees key j when j <= i in the same document."""
    s = segments.shape[1]
    causal = torch.ones(s, s, dtype=torch.bool, device=segments.device).tril()
    return causal & (segments[:, None, :, None] == segments[:, None, None, :])


@lru_cache(maxsize=4)
def _flex_attention(compiled: bool):
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False) if compiled else flex_attention


def document_block_mask(segments: torch.Tensor):
    """FlexAttention's block mask for causal attention within the documents of `segments`."""
    from torch.nn.attention.flex_attention import create_block_mask

    def same_document_causal(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (segments[b, q_idx] == segments[b, kv_idx])

    b, s = segments.shape
    return create_block_mask(same_document_causal, b, None, s, s, device=segments.device)


def flex_document_attention(q, k, v, segments: torch.Tensor, compiled: bool = True, block=None):
    """Causal attention within documents by FlexAttention's block mask (`block`, else made
    from `segments`): blocks of keys that no query of a block may see (another document, or
    after it) are skipped, never an s x s mask.  `compiled=False` runs FlexAttention's eager
    reference (any device, slow: for tests)."""
    block = document_block_mask(segments) if block is None else block
    gqa = {"enable_gqa": True} if k.shape[1] != q.shape[1] else {}
    return _flex_attention(compiled)(q, k, v, block_mask=block, **gqa)
