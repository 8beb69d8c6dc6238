"""The mixture-of-experts MLP that fills a layer's MLP slot (`models.mlp`) on its MoE layers
(`is_moe_layer`, chosen in `models.spec`), from megacore.moe's functions.

`MoELayer` (parameter names are part of the checkpoint and HF contracts):
- `router.weight` [E, h]: the router, replicated; its logits in fp32.  `router.bias` [E]
  (`add_bias_linear`, Megatron-LM's and gpt-oss's router bias): added to the logits.
  `router.expert_bias` [E] (fp32 buffer, `moe_router_enable_expert_bias`): added to the
  scores to choose the experts, never to their weights; moved once per optimizer step by
  `update_expert_biases`.  Group-limited routing (`moe_router_num_groups`) is DeepSeek's.
- `experts.weight1` [E_local, h, f_or_2f / etp] and `experts.weight2` [E_local, f / etp, h]:
  this rank's experts (ids `ep_rank x E_local + i`, E_local = E / ep), fc1 column-split and
  fc2 row-split over expert tensor parallelism (gated: weight1 is [gate | up], each half
  split apart, `megacore.moe.fc1_shard`).  With `add_bias_linear`, `experts.bias1`
  [E_local, f_or_2f / etp] split as weight1's columns and `experts.bias2` [E_local, h / etp]:
  fc2's bias, its h columns shared out over ETP (`megacore.moe.fc2_bias_share`), so the
  partial sums hold it once and every element lives on one rank.
- `shared_expert.*` (`moe_shared_expert_intermediate_size`): a dense MLP every token goes
  through, tensor-parallel as `ParallelMLP`; `shared_expert_gate.weight` [1, h]
  (`moe_shared_expert_gate`, Qwen2-MoE): its output (with its fc2 bias) times
  sigmoid(gate(x)).
- `dispatcher`: how tokens reach the experts (`megacore.moe.LocalDispatcher` on one
  process).

Weights are drawn so that every layout holds the numbers of one process: the router, the
shared expert and its gate from the layer's generator in that order, then one int64 from it
that seeds a generator per expert (expert e: that seed + e), which draws the expert's full
fc1 then fc2; each rank keeps its experts and its etp slice.  Biases start at zero (as
Megatron-LM's), drawing nothing.

The auxiliary losses (`moe_aux_loss_coeff`, `moe_z_loss_coeff`) reach the router through
`MoEAuxLossAutoScaler`: the forward's output and the LM loss are unchanged, and their
gradients are scaled as the main loss's (`set_aux_loss_scale`, by the train step).  Per
step the layer keeps its load: the choices its tokens made of each expert and how many
were dropped (counted in training forwards with gradients, once per microbatch under
recompute).
"""

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from megacore import moe
from megacore import tensor_parallel as tp
from megatrain.models.mlp import ParallelMLP


@dataclass(frozen=True)
class ExpertPlace:
    """Where this rank's experts sit: the expert-parallel rank and size (which experts it
    holds) and the expert-tensor-parallel rank and size (which slice of each).  Read from
    the layout's `ParallelContext` fields ep_rank, ep_size, etp_rank, etp_size (one process
    when it has none)."""

    ep_rank: int = 0
    ep_size: int = 1
    etp_rank: int = 0
    etp_size: int = 1

    @classmethod
    def of(cls, parallel) -> "ExpertPlace":
        return cls(*(getattr(parallel, f.name, f.default) for f in dataclasses.fields(cls)))


def is_moe_layer(cfg, layer_number: int) -> bool:
    """Whether layer `layer_number` (0-based) is a MoE layer: `moe_layer_freq` N makes every
    Nth one (layer i when i % N == 0), a list of 0/1 names each layer (Megatron's); a layer
    past the list (multi-token prediction's) is of the last layer's kind (Megatron-LM's MTP
    takes the decoder's last layer spec)."""
    if not cfg.num_moe_experts:
        return False
    freq = cfg.moe_layer_freq
    if isinstance(freq, int):
        return layer_number % freq == 0
    return bool(freq[min(layer_number, len(freq) - 1)])


def _activation(cfg) -> str:
    if cfg.swiglu:
        return "quick_geglu" if cfg.quick_geglu else "swiglu"
    return "gelu_tanh" if cfg.gelu == "tanh" else "gelu"


class TopKRouter(nn.Module):
    """The router's weight, bias and expert bias; `forward(tokens [T, h], batch)` -> (probs
    [T, k], indices [T, k], with dropped choices -1), the auxiliary losses attached.  With a
    capacity, the drops are one process's at every layout (`token_layout`)."""

    def __init__(self, cfg, place: dict):
        super().__init__()
        self.cfg = cfg
        self.weight = _replicated_weight(cfg, cfg.num_moe_experts, place)
        self.bias = None
        if cfg.add_bias:  # replicated as the weight, its gradient partial under SP
            zeros = torch.zeros(cfg.num_moe_experts, device=place["device"])
            self.bias = nn.Parameter(zeros.to(place["params_dtype"]))
            self.bias.sequence_parallel = cfg.sequence_parallel
        if cfg.moe_router_enable_expert_bias:  # fp32 whatever the model's dtype (Megatron's)
            zeros = torch.zeros(cfg.num_moe_experts, device=place["device"])
            self.register_buffer("expert_bias", zeros)
        else:
            self.expert_bias = None
        # The group whose ranks hold the other tokens of the same sequences (tensor x context
        # parallel under sequence parallelism); None: this rank holds them all.
        # Part of megacore.moe's gradient-scale rule: the losses are this rank's shares over it,
        # their gradient scaled by MoEAuxLossAutoScaler (the main loss's scale x cp).
        self.aux_loss_group = None
        # Where the microbatch's other tokens are (`megacore.moe.TokenLayout`, set by
        # parallelize.expert_parallel when sequence or context parallelism spreads them):
        # capacity drops are decided over all of them, as one process decides them.
        self.token_layout = None
        self.last_aux_loss = None  # this microbatch's aux (or seq aux) loss / coeff, detached

    def forward(self, tokens: torch.Tensor, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.cfg
        bias = None if self.bias is None else self.bias.float()
        logits = F.linear(tokens.float(), self.weight.float(), bias)
        train = self.training and torch.is_grad_enabled()
        if train and cfg.moe_z_loss_coeff:
            z = moe.z_loss(logits, cfg.moe_z_loss_coeff, self.aux_loss_group)
            logits = moe.MoEAuxLossAutoScaler.apply(logits, z)
        probs, indices = moe.topk_routing(
            logits,
            cfg.moe_router_topk,
            score_function=cfg.moe_router_score_function,
            pre_softmax=cfg.moe_router_pre_softmax,
            norm_topk_prob=cfg.moe_router_norm_topk_prob,
            scaling_factor=cfg.moe_router_topk_scaling_factor,
            expert_bias=self.expert_bias,
            num_groups=cfg.moe_router_num_groups,
            group_topk=cfg.moe_router_group_topk,
            group_score_topk=cfg.moe_router_group_score_topk,
        )
        if cfg.moe_expert_capacity_factor is not None:
            capacity = (cfg.num_moe_experts, cfg.moe_expert_capacity_factor)
            if self.token_layout is None:
                indices = moe.drop_over_capacity(
                    probs, indices, *capacity, cfg.moe_token_drop_policy
                )
            else:
                indices = moe.drop_over_capacity_in_layout(
                    probs, indices, *capacity, cfg.moe_token_drop_policy, self.token_layout, batch
                )
        kind, coeff = cfg.moe_router_load_balancing_type, cfg.moe_aux_loss_coeff
        if train and coeff and kind != "none":
            scores, routing_map = moe.routing_scores_for_aux_loss(
                logits, cfg.moe_router_topk, cfg.moe_router_score_function
            )
            if kind == "aux_loss":
                loss = moe.switch_load_balancing_loss(
                    scores, routing_map, cfg.moe_router_topk, coeff, self.aux_loss_group
                )
            else:  # seq_aux_loss: tokens are [s, b] in order
                E = cfg.num_moe_experts
                loss = moe.sequence_load_balancing_loss(
                    scores.view(-1, batch, E), routing_map.view(-1, batch, E),
                    cfg.moe_router_topk, coeff, self.aux_loss_group,
                )  # fmt: skip
            self.last_aux_loss = loss.detach() / coeff
            probs = moe.MoEAuxLossAutoScaler.apply(probs, loss)
        return probs, indices


class GroupedExperts(nn.Module):
    """This rank's experts as two 3-D weights (see the module's docstring)."""

    def __init__(self, cfg, place: dict, experts: ExpertPlace, seed: int):
        super().__init__()
        E, h = cfg.num_moe_experts, cfg.hidden_size
        f = cfg.moe_ffn_hidden_size or cfg.ffn_hidden_size
        self.num_local = tp.divide(E, experts.ep_size, "num_moe_experts", "ep size")
        f_local = tp.divide(f, experts.etp_size, "moe_ffn_hidden_size", "etp size")
        self.first = experts.ep_rank * self.num_local  # the global id of local expert 0
        self.activation, self.grouped = _activation(cfg), cfg.moe_grouped_gemm
        self.glu = {
            "glu_linear_offset": cfg.glu_linear_offset,
            "clamp_value": cfg.activation_func_clamp_value,
        }
        self.etp_rank, self.etp_size = experts.etp_rank, experts.etp_size
        swiglu = cfg.swiglu
        width = 2 * f if swiglu else f
        kw = {"device": place["device"], "dtype": place["params_dtype"]}
        weight1 = torch.empty(self.num_local, h, width // experts.etp_size, **kw)
        weight2 = torch.empty(self.num_local, f_local, h, **kw)
        if place["perform_initialization"]:
            fc1 = tp.init_method_normal(cfg.init_method_std)
            fc2 = tp.scaled_init_method_normal(cfg.init_method_std, cfg.num_layers)
            rank, size = experts.etp_rank, experts.etp_size
            with torch.no_grad():
                for i in range(self.num_local):  # at build time only
                    gen = torch.Generator().manual_seed(seed + self.first + i)
                    full1, full2 = torch.empty(h, width), torch.empty(f, h)
                    fc1(full1, generator=gen)
                    fc2(full2, generator=gen)
                    weight1[i].copy_(moe.fc1_shard(full1, rank, size, swiglu))
                    weight2[i].copy_(full2.chunk(size, dim=0)[rank])
        self.weight1, self.weight2 = nn.Parameter(weight1), nn.Parameter(weight2)
        self.bias1 = self.bias2 = None
        if cfg.add_bias:
            h_local = tp.divide(h, experts.etp_size, "hidden_size", "etp size")
            self.bias1 = nn.Parameter(torch.zeros(self.num_local, width // experts.etp_size, **kw))
            self.bias2 = nn.Parameter(torch.zeros(self.num_local, h_local, **kw))
        for w in self.expert_parameters():
            # Megatron's mark of an expert parameter: reduced over the expert-data-parallel
            # group, not the dense data-parallel one, yet divided by the dense DP x CP size
            # (part of megacore.moe's gradient-scale rule).
            w.allreduce = False

    def expert_parameters(self) -> list[nn.Parameter]:
        """weight1, weight2 and, with biases, bias1 and bias2."""
        return [p for p in (self.weight1, self.weight2, self.bias1, self.bias2) if p is not None]

    def forward(self, x: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        grouped = None if self.grouped else False
        b2 = self.bias2
        if b2 is not None:
            b2 = moe.fc2_bias_share(b2, self.etp_rank, self.etp_size)
        return moe.grouped_mlp(
            x, tokens_per_expert, self.weight1, self.weight2, self.activation, grouped,
            b_fc1=self.bias1, b_fc2=b2, **self.glu,
        )  # fmt: skip


class MoELayer(nn.Module):
    """Routed experts (and a shared expert) in place of the dense MLP; `forward(x [s, b, h])`
    returns (output, None) as `ParallelMLP` returns (output, bias)."""

    def __init__(self, cfg, place: dict, parallel=None):
        super().__init__()
        self.cfg = cfg
        experts = ExpertPlace.of(parallel)
        self.router = TopKRouter(cfg, place)
        self.shared_expert = self.shared_expert_gate = None
        if cfg.moe_shared_expert_intermediate_size:
            size = cfg.moe_shared_expert_intermediate_size
            self.shared_expert = ParallelMLP(dataclasses.replace(cfg, ffn_hidden_size=size), place)
            if cfg.moe_shared_expert_gate:
                self.shared_expert_gate = SharedExpertGate(cfg, place)
        seed = 0
        if place["perform_initialization"]:
            seed = int(torch.randint(2**62, (), generator=place["generator"]))
        self.experts = GroupedExperts(cfg, place, experts, seed)
        self.dispatcher = moe.LocalDispatcher(
            cfg.num_moe_experts, dropless=cfg.moe_expert_capacity_factor is None
        )
        # The step's load (`load_statistics`), over its training microbatches: the choices
        # this rank's tokens made of each of the E experts (what the expert bias balances),
        # and how many choices were made and dropped by capacity.
        E, device = cfg.num_moe_experts, place["device"]
        count = {"dtype": torch.int64, "device": device}
        self.register_buffer("tokens_per_expert", torch.zeros(E, **count), persistent=False)
        self.register_buffer("dropped", torch.zeros((), **count), persistent=False)
        self.choices = 0
        self.aux_losses: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        s, b, h = x.shape
        tokens = x.reshape(s * b, h)
        probs, indices = self.router(tokens, b)
        expert_input, counts = self.dispatcher.dispatch(tokens, probs, indices)
        expert_output = self.experts(expert_input, counts)
        out = self.dispatcher.combine(expert_output).view(s, b, h)
        if self.training and torch.is_grad_enabled():  # once per microbatch under recompute
            with torch.no_grad():
                chosen = moe.tokens_per_expert(indices, self.cfg.num_moe_experts)
                self.tokens_per_expert += chosen
                self.dropped += indices.numel() - chosen.sum()
                self.choices += indices.numel()
            if self.router.last_aux_loss is not None:
                self.aux_losses.append(self.router.last_aux_loss)
                self.router.last_aux_loss = None
        if self.shared_expert is not None:
            shared, bias = self.shared_expert(x)
            if bias is not None:  # fc2's, which a dense layer adds in bias_dropout_add
                shared = shared + bias
            if self.shared_expert_gate is not None:
                shared = shared * torch.sigmoid(self.shared_expert_gate(x))
            out = out + shared
        return out, None


def _replicated_weight(cfg, rows: int, place: dict) -> nn.Parameter:
    """A [rows, h] weight replicated over TP, drawn from the layer's generator.  Under sequence
    parallelism each TP rank applies it to its own tokens: its gradient is partial, summed
    over TP as the norms' are (`sequence_parallel`)."""
    weight = torch.empty(rows, cfg.hidden_size, device=place["device"], dtype=place["params_dtype"])
    if place["perform_initialization"]:
        master = torch.empty(rows, cfg.hidden_size)
        tp.init_method_normal(cfg.init_method_std)(master, generator=place["generator"])
        with torch.no_grad():
            weight.copy_(master)
    weight = nn.Parameter(weight)
    weight.sequence_parallel = cfg.sequence_parallel
    return weight


class SharedExpertGate(nn.Module):
    """Qwen2-MoE's gate of the shared expert: a [1, h] linear, no bias (sigmoid applied by
    the layer)."""

    def __init__(self, cfg, place: dict):
        super().__init__()
        self.weight = _replicated_weight(cfg, 1, place)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


def moe_layers(chunks) -> list[MoELayer]:
    """The MoE layers of a rank's chunks (through any wrapper), in order."""
    return [m for chunk in chunks for m in chunk.modules() if isinstance(m, MoELayer)]


def begin_step(chunks, aux_loss_scale: torch.Tensor | float) -> None:
    """Before a step's microbatches: the auxiliary losses' gradient scale (the main loss's,
    `MoEAuxLossAutoScaler`) and each layer's load counted from zero."""
    moe.MoEAuxLossAutoScaler.set_loss_scale(aux_loss_scale)
    for layer in moe_layers(chunks):
        layer.tokens_per_expert.zero_()
        layer.dropped.zero_()
        layer.choices = 0
        layer.aux_losses.clear()


def aux_loss_value(chunks) -> torch.Tensor | None:
    """The step's load-balancing loss (without its coefficient), the mean over this rank's MoE
    layers of each layer's mean over the microbatches; None when no layer computed one."""
    means = [torch.stack(m.aux_losses).mean() for m in moe_layers(chunks) if m.aux_losses]
    return torch.stack(means).mean() if means else None


def update_expert_biases(chunks, rate: float) -> None:
    """Once per optimizer step: each layer's expert bias moved by its step's token counts
    (`megacore.moe.update_expert_bias`).  The counts are this rank's tokens'."""
    for layer in moe_layers(chunks):
        if layer.router.expert_bias is not None:
            moe.update_expert_bias(layer.router.expert_bias, layer.tokens_per_expert, rate)
