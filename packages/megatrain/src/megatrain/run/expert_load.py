"""The experts' load over a log interval (issue 45 item 8): how evenly each MoE layer's router
spreads the tokens, in log.jsonl and TensorBoard, and one line when a router collapses.

Each step `train_step` leaves on every MoE layer the choices its tokens made of each expert,
already summed over the ranks of the pipeline stage (`parallelize.sum_expert_loads`, which the
expert-bias update needs anyway), and the choices dropped over capacity.  `ExpertLoad.add`
adds them up on the device each step (no host read, no collective); `ExpertLoad.fields`, at a
log iteration only, sums the stages' layers over the pipeline group (one all-reduce of
[layers, E + 2] numbers) and reads them once.

Per layer (`layer<i>`, the model's 0-based layer number):
- `moe_load`: the busiest expert's tokens over the mean (1: balanced; E / k: every token on
  the same k experts), of the tokens the experts took (with a capacity, after the drops);
- `moe_dropped` (with `moe_expert_capacity_factor`): the fraction of choices dropped.

A collapsed router: a layer whose max/mean reaches `COLLAPSE_RATIO`, where fewer than half
of the experts got any token, or (with a capacity, which caps max/mean near its factor) whose
dropped fraction reaches `COLLAPSE_DROPPED`; `collapse_line` names them in one line.
"""

import torch
import torch.distributed as dist

from megacore import parallel_state as ps
from megatrain.models.moe import MoELayer

COLLAPSE_RATIO = 3.0  # the busiest expert with 3x its share (E=8, k=2: 3/4 of the tokens)
COLLAPSE_DROPPED = 0.25  # a quarter of the choices over capacity


def _numbered_moe_layers(chunks) -> list[tuple[int, MoELayer]]:
    """(the model's layer number, its MoE layer) of a rank's chunks, through any wrapper."""
    found = []
    for chunk in chunks:
        for module in chunk.modules():
            layers = getattr(module, "layers", None)
            if isinstance(layers, torch.nn.ModuleDict) and hasattr(module, "layer_ids"):
                found += [(int(i), lay.mlp) for i, lay in layers.items()
                          if isinstance(lay.mlp, MoELayer)]  # fmt: skip
    return found


class ExpertLoad:
    """Each MoE layer's tokens per expert, dropped and made choices, over a log interval."""

    def __init__(self, chunks, num_layers: int, num_experts: int, device):
        self.layers = _numbered_moe_layers(chunks)
        self.num_layers, self.num_experts = num_layers, num_experts
        # [layer, expert] tokens; then the dropped choices and all choices made
        self.totals = torch.zeros(num_layers, num_experts + 2, dtype=torch.int64, device=device)

    def add(self) -> None:
        """After a step: its load (the layers' counts, summed over the stage) added up."""
        for i, layer in self.layers:
            self.totals[i, :-2] += layer.tokens_per_expert
            self.totals[i, -2] += layer.dropped
            self.totals[i, -1] += layer.choices

    def fields(self, capacity: bool) -> dict:
        """The interval's `moe_load` (and with `capacity` `moe_dropped`) per layer, every
        stage's (every rank calls it: one all-reduce over the pipeline group); counted from
        zero again."""
        totals = self.totals.clone()
        self.totals.zero_()
        if ps.model_parallel_is_initialized() and ps.get_pipeline_model_parallel_world_size() > 1:
            dist.all_reduce(totals, group=ps.get_pipeline_model_parallel_group())
        rows = totals.tolist()  # the one read at a log iteration
        load, dropped, used = {}, {}, {}
        for i, row in enumerate(rows):
            tokens, choices = row[:-2], row[-1]
            if choices == 0:  # a dense layer, or no training step
                continue
            mean = sum(tokens) / len(tokens)
            load[f"layer{i}"] = max(tokens) / mean if mean else float("inf")
            dropped[f"layer{i}"] = row[-2] / choices
            used[f"layer{i}"] = sum(t > 0 for t in tokens)
        self.used = used
        fields = {"moe_load": load}
        if capacity:
            fields["moe_dropped"] = dropped
        return fields

    def collapse_line(self, fields: dict, iteration: int) -> str | None:
        """One line naming the layers whose router collapsed in the interval, or None."""
        E, dropped = self.num_experts, fields.get("moe_dropped", {})
        bad = [
            f"{name} max/mean {ratio:.2f}, {self.used[name]} of {E} experts took tokens"
            + (f", {dropped[name]:.1%} dropped" if name in dropped else "")
            for name, ratio in fields["moe_load"].items()
            if ratio >= COLLAPSE_RATIO
            or 2 * self.used[name] < E
            or dropped.get(name, 0.0) >= COLLAPSE_DROPPED
        ]
        if not bad:
            return None
        limits = f"max/mean >= {COLLAPSE_RATIO:g}, under half the experts used"
        if dropped:
            limits += f" or >= {COLLAPSE_DROPPED:.0%} dropped"
        return f"megatrain: router collapse by iteration {iteration} ({limits}): " + "; ".join(bad)
