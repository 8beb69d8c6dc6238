"""Text generation from a checkpoint: greedy, top-k and top-p sampling, with a KV cache, at any tp.

Every tensor-parallel rank runs the same loop.  The logits of a step are this
rank's slice of the vocabulary; they are gathered, filtered and sampled
identically on every rank (the same seeded generator), and the token of the
first rank of the group is broadcast so the ranks can never drift apart.
Generation runs on one pipeline stage (pp = 1): decoding is a token at a time,
which a pipeline would only serialise.
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist

from megacore import parallel_state as ps
from megacore import tensor_parallel as tp
from megatrain.config import CAUSAL_KINDS
from megatrain.models.attention.kv_cache import KVCache
from megatrain.models.gpt import GPTModel


@dataclass
class Sampling:
    max_new_tokens: int = 64
    greedy: bool = False
    temperature: float = 1.0
    top_k: int = 0  # 0: no top-k filter
    top_p: float = 1.0  # 1.0: no nucleus filter
    seed: int = 0
    stop_at_eod: bool = True

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ValueError(f"--max-new-tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature <= 0:
            raise ValueError(f"--temperature must be > 0, got {self.temperature} (use --greedy)")
        if self.top_k < 0:
            raise ValueError(f"--top-k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"--top-p must be in (0, 1], got {self.top_p}")


def filter_logits(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Logits [..., V] with everything outside the top k, and outside the smallest set whose
    probability reaches top_p (the token that crosses it included), set to -inf."""
    logits = logits.clone()
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits[logits < kth] = float("-inf")
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        before = torch.cumsum(probs, dim=-1) - probs  # mass of the better tokens
        drop_sorted = before >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits[drop] = float("-inf")
    return logits


def next_token(
    local_logits: torch.Tensor, vocab_size: int, sampling: Sampling, generator: torch.Generator
) -> int:
    """The next token from this rank's vocabulary slice of the last position's logits [V/tp].

    The padding (which depends on tp) is cut off first, so that every layout samples
    from the same vector with the same random numbers."""
    logits = tp.gather_from_tensor_model_parallel_region(local_logits.float())[:vocab_size]
    if sampling.greedy:
        token = torch.argmax(logits, dim=-1)
    else:
        logits = filter_logits(logits / sampling.temperature, sampling.top_k, sampling.top_p)
        probs = torch.softmax(logits, dim=-1)
        token = torch.multinomial(probs.cpu(), 1, generator=generator)[0].to(logits.device)
    token = token.reshape(1).long()
    if ps.get_tensor_model_parallel_world_size() > 1:
        dist.broadcast(
            token, ps.get_tensor_model_parallel_src_rank(), ps.get_tensor_model_parallel_group()
        )
    return int(token.item())


@torch.no_grad()
def generate(
    model: GPTModel,
    prompt: list[int],
    sampling: Sampling,
    eod_id: int | None = None,
    use_cache: bool = True,
) -> list[int]:
    """The new tokens after `prompt` (without it); every TP rank calls this with the same input."""
    if ps.get_pipeline_model_parallel_world_size() != 1:
        raise ValueError("generation runs at pipeline size 1; split the model with tp instead")
    if not prompt:
        raise ValueError("the prompt is empty: give at least one token")
    limit = model.config.max_position_embeddings
    vocab_size = model.config.true_vocab_size or model.config.vocab_size
    if len(prompt) >= limit:
        raise ValueError(f"the prompt has {len(prompt)} tokens; the model takes at most {limit}")
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(sampling.seed)
    steps = min(sampling.max_new_tokens, limit - len(prompt))
    cache = KVCache(max_length=len(prompt) + steps) if use_cache else None
    tokens, new = list(prompt), []
    feed = prompt
    for _ in range(steps):
        x = torch.tensor([feed if use_cache else tokens], dtype=torch.long, device=device)
        logits = model(x, cache=cache)  # [s, 1, V/tp]
        token = next_token(logits[-1, 0], vocab_size, sampling, generator)
        new.append(token)
        tokens.append(token)
        feed = [token]
        if sampling.stop_at_eod and token == eod_id:
            break
    return new


def generation_worker(
    ckpt: str, tp_size: int, prompts: list[str], sampling: dict, use_cache: bool, complete=None
) -> list[dict] | None:
    """One rank of `megatrain generate`: the completions on rank 0, None elsewhere.
    `complete(model, ids, sampling, eod_id) -> (new tokens, statistics)` in the place of
    `generate` (`speculative.generate_speculative`), its statistics in each result."""
    from megatrain.inference.load import load_model
    from megatrain.run.distributed import init_distributed

    device, _ = init_distributed()
    ps.initialize_model_parallel(tp_size, 1)
    loaded = load_model(ckpt, device, kind=CAUSAL_KINDS)
    results = []
    for text in prompts:
        ids = loaded.tokenizer.encode(text).ids
        model, how = loaded.chunks[0], Sampling(**sampling)
        if complete is None:
            new, stats = generate(model, ids, how, loaded.eod_id, use_cache), {}
        else:
            new, stats = complete(model, ids, how, loaded.eod_id)
        text_out = loaded.tokenizer.decode(new)
        results.append({"prompt": text, "tokens": new, "text": text_out, **stats})
    return results if dist.get_rank() == 0 else None
