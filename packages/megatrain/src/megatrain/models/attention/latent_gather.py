"""Multi-latent attention's own context-parallel comm type, `parallel.cp_comm_type = "latent"`:
all-gather over the CP group what each token's keys and values are made from, not the keys
and values.

Each CP rank holds two chunks of the sequence (`megacore.context_parallel`).  MLA's keys and
values are a per-token function of the normalized KV latent (`kv_lora_rank`) and the rotated
rope key (`qk_pos_emb_head_dim`, one for all heads): every rank gathers those, kv_lora_rank +
qk_pos_emb_head_dim numbers a token (576 for DeepSeek-V3, against 128 heads x (192 + 128) =
40,960 for its up-projected K and V), up-projects the whole sequence's keys and values with
its own copy of `kv_b` and attends its local queries against them with the causal mask of
the gathered keys' global positions (and their documents, with packed documents).

Exact, forward and backward.  The latent is gathered after its RMSNorm and the rope key after
its rotation: both are per token and computed on the rank that holds the token, at its global
position, so the gathered tensors are the ones one process computes.  The all-gather's
backward reduce-scatters: each token's latent gradient is the sum over the CP ranks whose
queries used it, landing on the rank that holds the token, which then runs the norm's and
the down-projection's backward for its own tokens as without CP.  `kv_b`'s gradient on each
rank covers its queries' share of the whole sequence; the gradient reduction over data x
context parallel ranks sums the shares, as for every other weight.

The cost: each rank up-projects cp times its own tokens' K/V (kv_lora_rank x heads x
(qk_head_dim + v_head_dim) multiply-adds a token, again for every rank that gathers it) and
holds the whole sequence's K/V as "allgather" does; one collective a layer, not overlapped.
The score computation is SDPA with a boolean mask (every score of the local queries against
the sequence computed, the masked half included), as "allgather" does.
"""

import torch

from megacore.tensor_parallel.mappings import gather_from_sequence_parallel_region
from megatrain.models.attention.inputs import AttentionInputs


def gather_latent(
    latent: torch.Tensor, k_rope: torch.Tensor, inputs: AttentionInputs | None, cp
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The whole sequence's latent [cp·s, b, kv_lora_rank] and rope key [b, 1, cp·s, rope],
    gathered over `cp` (a `parallelize.ContextParallel`) from this rank's latent [s, b,
    kv_lora_rank] and rope key [b, 1, s, rope], and the boolean mask [b or 1, 1, s, cp·s] of
    the gathered keys each local query sees (causal by global position, within its document).
    One collective for both tensors; its backward reduce-scatters their gradients."""
    s, rank = latent.shape[0], latent.shape[-1]
    joint = torch.cat([latent, k_rope.squeeze(1).transpose(0, 1)], dim=-1)
    joint = gather_from_sequence_parallel_region(joint.contiguous(), True, cp.group)
    latent, k_rope = joint.split([rank, joint.shape[-1] - rank], dim=-1)
    k_rope = k_rope.permute(1, 0, 2).unsqueeze(1)
    positions = cp.positions(s, latent.device)
    keys = cp.gathered_positions(s, latent.device)
    visible = (keys[None, :] <= positions[:, None])[None, None]
    segments = inputs.segments if inputs is not None else None
    if segments is not None:  # the gathered keys' documents, in the same order (no gradient)
        key_segments = gather_from_sequence_parallel_region(
            segments.t().contiguous(), True, cp.group
        ).t()
        visible = visible & (segments[:, :, None] == key_segments[:, None, :])[:, None]
    return latent, k_rope, visible
