"""Multi-token prediction's depths on the last pipeline stage: the seconds they add to it
(`cost_model.estimate` adds them to the last stage's layers)."""

from megatrain.config import Config
from megatrain.models.moe import is_moe_layer
from megatrain.models.transformer_config import TransformerConfig
from megatrain.plan.accounting import mtp_layer_numbers
from megatrain.plan.costs import Costs
from megatrain.plan.layout import Layout


def mtp_seconds(
    config: Config,
    layout: Layout,
    costs: Costs,
    layers: dict,
    embed: dict,
    head: dict,
    bandwidth: float,
    cfg: TransformerConfig,
) -> dict:
    """Seconds multi-token prediction's depths (`model.mtp_num_layers`, `models.mtp`) add to
    the last pipeline stage for one microbatch on one TP rank, by part; {} without them.  Each
    depth: the word embedding of the tokens k ahead (`embed`, the first stage's), enorm and
    hnorm over them and the states before, eh_proj ([2h] -> [h], column-parallel: its input
    all-gathered over the sequence and its gradient reduce-scattered under sequence
    parallelism, the input gradient all-reduced without; its output's columns all-gathered
    over TP), one transformer layer of its position's kind (`layers`: {False: a dense
    layer's `layer_seconds`, True: a MoE layer's}, recompute as the model's layers) and its
    final norm, and the output layer and loss again (`head`, `_ends`')."""
    depths = cfg.mtp_num_layers or 0
    if not depths:
        return {}
    t, h, tp = config.training, cfg.hidden_size, layout.tp
    tokens = t.seq_length // layout.cp * layout.micro_batch
    sp = layout.sequence_parallel
    activation = costs.element * tokens * h
    eh_forward, eh_backward = costs.gemm_fwd_bwd(tokens, h / tp, 2 * h)
    # enorm, hnorm, the concatenation and the final norm: passes over [s, b, h] (/ t with sp)
    norms = 3 * 4 * costs.elementwise(activation / (tp if sp else 1))
    if sp:
        eh_comm = 2 * costs.collective("all_gather", 2 * activation, tp, bandwidth)
        eh_comm += 2 * costs.collective("all_gather", activation, tp, bandwidth)
    else:
        eh_comm = costs.collective("all_gather", activation, tp, bandwidth)
        eh_comm += costs.collective("all_reduce", 2 * activation, tp, bandwidth)
    own = {"compute": eh_forward + eh_backward + norms, "tp_comm": eh_comm}
    total = {k: 0.0 for k in ("compute", "tp_comm", "cp_comm", "ep_comm")}
    for position in mtp_layer_numbers(cfg):
        layer = layers[is_moe_layer(cfg, position)]
        for k in total:
            total[k] += layer[k] + own.get(k, 0.0) + embed.get(k, 0.0) + head.get(k, 0.0)
    return total
