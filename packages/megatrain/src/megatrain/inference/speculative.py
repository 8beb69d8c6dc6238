"""Greedy generation drafted by the model's own multi-token prediction depths and verified by the
model (`megatrain generate --speculative mtp`): the output is plain greedy generation's.

Each round, with the accepted tokens T (n of them), the model's final states H of their
positions and the next token g (the model's greedy choice after T):

- draft: depth k of `models.mtp` runs over positions 0..n-1 with the tokens k ahead (T, g and
  the drafts before it) and proposes, from position n-1, the token k + 1 past T's end;
- verify: the model runs g and the D drafts at positions n..n+D through its KV cache in one
  forward; a draft is accepted while it is the model's own greedy choice after the tokens
  before it, and the model's choice after the last accepted one is the next round's g;
- the cache goes back to the accepted positions (its later entries are overwritten by the
  next round's), H keeps the accepted positions' states.

Every token given out is the model's greedy choice after the ones before it, so the tokens
are plain greedy generation's (up to the rounding of one forward over several positions
against several of one).  The depths run uncached over the whole sequence each round (they
are one layer each).  The acceptance rate is the accepted drafts over the drafted ones.
"""

import torch

from megatrain.inference.generate import Sampling, next_token
from megatrain.models.attention.kv_cache import KVCache
from megatrain.models.gpt import GPTModel


def check_speculative(mtp_num_layers: int | None, window_size: int | None, where: str) -> None:
    """What drafting with the depths needs of the model of `where` (a checkpoint, before any
    worker starts; a model), refused in a line naming the field."""
    if not mtp_num_layers:
        raise ValueError(
            "--speculative mtp drafts with the model's multi-token prediction depths; "
            f"{where} has none (model.mtp_num_layers is unset)"
        )
    if window_size is not None:
        raise ValueError(
            f"--speculative mtp with model.window_size ({where}): a sliding layer's cache keeps "
            "only its window, which a rejected draft could not be taken back from"
        )


def _hidden(model: GPTModel, tokens: list[int], cache: KVCache, device) -> torch.Tensor:
    """The model's final states [s, 1, h] of `tokens` after the cached positions, cached."""
    x = torch.tensor([tokens], dtype=torch.long, device=device)
    states = model.run_layers(model.embed(x, cache.offset), None, cache)
    cache.offset += len(tokens)
    return states


def _greedy(model: GPTModel, states: torch.Tensor) -> list[int]:
    """The greedy token after each position of `states` [s, 1, h] (every TP rank alike)."""
    vocab = model.config.true_vocab_size or model.config.vocab_size
    logits = model.logits(states)
    pick = Sampling(greedy=True)
    return [next_token(logits[i, 0], vocab, pick, None) for i in range(logits.shape[0])]


def _draft(model: GPTModel, states: torch.Tensor, tokens: list[int], count: int) -> list[int]:
    """`count` drafts after `tokens` (T and g) from the depths over T's positions, `states`."""
    n, drafts = states.shape[0], []
    extended = list(tokens)
    device = states.device
    for k, depth in enumerate(list(model.mtp.layers.values())[:count], start=1):
        ahead = torch.tensor([extended[k : k + n]], dtype=torch.long, device=device)
        states = depth(model, model.embed_words(ahead), states, None)
        drafts.append(_greedy(model, states[-1:])[0])
        extended.append(drafts[-1])
    return drafts


@torch.no_grad()
def generate_speculative(
    model: GPTModel, prompt: list[int], sampling: Sampling, eod_id: int | None = None
) -> tuple[list[int], dict]:
    """(the new tokens after `prompt`, {"drafted", "accepted"}): `generate`'s greedy tokens,
    drafted by the depths and verified by the model; every TP rank calls it alike."""
    check_speculative(model.config.mtp_num_layers, model.config.window_size, "the model")
    limit = model.config.max_position_embeddings
    if not prompt:
        raise ValueError("the prompt is empty: give at least one token")
    if len(prompt) >= limit:
        raise ValueError(f"the prompt has {len(prompt)} tokens; the model takes at most {limit}")
    device = next(model.parameters()).device
    steps = min(sampling.max_new_tokens, limit - len(prompt))
    depths = model.config.mtp_num_layers
    cache = KVCache(max_length=limit)
    states = _hidden(model, prompt, cache, device)
    tokens, new = list(prompt), []
    token = _greedy(model, states[-1:])[0]
    stats = {"drafted": 0, "accepted": 0}
    while True:
        new.append(token)
        tokens.append(token)
        if len(new) == steps or (sampling.stop_at_eod and token == eod_id):
            return new, stats
        # Drafts the positions left can hold (g and the drafts at n..n+D), at most the ones
        # still wanted.
        count = min(depths, limit - len(tokens), steps - len(new))
        drafts = _draft(model, states, tokens, count) if count else []
        verified = _hidden(model, [token, *drafts], cache, device)
        choices = _greedy(model, verified)
        accepted = 0
        while accepted < len(drafts) and choices[accepted] == drafts[accepted]:
            accepted += 1
        stats["drafted"] += len(drafts)
        stats["accepted"] += accepted
        cache.offset = len(tokens) + accepted  # the rejected drafts' entries are overwritten
        states = torch.cat([states, verified[: accepted + 1]])
        for draft in drafts[:accepted]:
            new.append(draft)
            tokens.append(draft)
            if len(new) == steps or (sampling.stop_at_eod and draft == eod_id):
                return new, stats
        token = choices[accepted]
