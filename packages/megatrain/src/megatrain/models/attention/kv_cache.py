"""The KV cache of generation: each attention layer's keys and values of the positions seen."""

from dataclasses import dataclass, field

import torch


@dataclass
class KVCache:
    """Keys and values of the positions seen so far, per layer (local heads of this TP rank).

    `offset` is the number of cached positions; `GPTModel.forward` advances it.
    """

    max_length: int
    offset: int = 0
    # layer id -> (keys, values) [b, heads, max, d]; multi-latent attention's: (its latent, its
    # rope key), one "head" each, of their own widths.
    layers: dict = field(default_factory=dict)

    def append(self, layer_id: int, k: torch.Tensor, v: torch.Tensor):
        """Store k, v [b, heads, s, d] (each its own heads and d) at the next positions; all
        cached keys and values."""
        s = k.shape[2]
        end = self.offset + s
        if end > self.max_length:
            raise ValueError(f"KVCache: {end} positions exceed max_length={self.max_length}")
        if layer_id not in self.layers:
            self.layers[layer_id] = tuple(
                t.new_empty((t.shape[0], t.shape[1], self.max_length, t.shape[3])) for t in (k, v)
            )
        keys, values = self.layers[layer_id]
        keys[:, :, self.offset : end] = k
        values[:, :, self.offset : end] = v
        return keys[:, :, :end], values[:, :, :end]

    def append_windowed(self, layer_id: int, k: torch.Tensor, v: torch.Tensor, window: int):
        """A sliding layer's append: keep only the window - 1 latest positions (all its next
        query can see) after this call; returns the keys and values the new queries see (the
        kept ones, then k, v) and the position of the first.  Memory: window - 1 + s positions,
        whatever the generated length."""
        end = self.offset + k.shape[2]
        if end > self.max_length:
            raise ValueError(f"KVCache: {end} positions exceed max_length={self.max_length}")
        kept = self.layers.get(layer_id)
        if kept is not None:
            k, v = torch.cat([kept[0], k], 2), torch.cat([kept[1], v], 2)
        first = end - k.shape[2]
        keep = min(window - 1, k.shape[2])
        start = k.shape[2] - keep  # copied, so the call's whole k, v are freed after it
        self.layers[layer_id] = (k[:, :, start:].clone(), v[:, :, start:].clone())
        return k, v, first
