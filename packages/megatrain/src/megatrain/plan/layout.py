"""A layout of a training config (tp, cp, pp, dp, virtual stages, micro batch, recompute,
the shardings and the expert layout), and the config at it: what `megatrain plan` searches
(`search.candidates`) and times (`cost_model.estimate`), and prints as overrides."""

from dataclasses import dataclass, replace

from megacore.pipeline_parallel.layer_assignment import LAYOUT_NAMES
from megatrain.config import Config
from megatrain.plan.accounting import RECOMPUTE_IMPLEMENTATIONS


@dataclass(frozen=True)
class Layout:
    tp: int
    pp: int
    dp: int
    vpp: int = 1
    micro_batch: int = 1
    recompute: str = "none"
    sequence_parallel: bool = False
    distributed_optimizer: bool = False
    schedule: str = "1f1b"  # the pipeline schedule: 1f1b, interleaved (vpp > 1) or zb-h1
    cp: int = 1  # context parallelism: each sequence split over cp ranks
    cp_comm: str = "p2p"  # its attention's communication: "p2p" (a ring), "allgather", "latent"
    fsdp: bool = False  # parallel.data_parallel_sharding = "full" (torch's FSDP2)
    ep: int = 1  # a mixture of experts: parallel.expert_model_parallel_size
    etp: int | None = None  # parallel.expert_tensor_parallel_size (None: tp)
    # FSDP reduce-scatters every microbatch's gradients (parallel.reduce_every_microbatch):
    # True or False as the plan tries both, None for the config's own choice
    reduce_every_microbatch: bool | None = None
    # parallel.pipeline_model_parallel_layout as Megatron-LM's string (None: the even split)
    pipeline_layout: str | None = None

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    @property
    def sharding(self) -> str:
        """parallel.data_parallel_sharding at this layout."""
        return "full" if self.fsdp else "optimizer" if self.distributed_optimizer else "none"

    @property
    def gpus(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    def describe(self) -> str:
        parts = [f"tp {self.tp}"]
        if self.cp > 1:
            parts.append(f"cp {self.cp} {self.cp_comm}")
        parts.append(f"pp {self.pp}")
        if self.vpp > 1:
            parts.append(f"vpp {self.vpp}")
        if self.schedule == "zb-h1" and self.pp > 1:
            parts.append("zb-h1")
        if self.pipeline_layout is not None:
            parts.append(f"layout {self.pipeline_layout}")
        parts += [f"dp {self.dp}", f"mb {self.micro_batch}", f"recompute {self.recompute}"]
        if self.sequence_parallel:
            parts.append("sp")
        if self.distributed_optimizer:
            parts.append("distopt")
        if self.fsdp:
            parts.append("fsdp")
        if self.fsdp and self.reduce_every_microbatch:
            parts.append("reduce-every-mb")
        if self.ep > 1 or self.etp is not None:
            parts.append(f"ep {self.ep} etp {self.expert_tp}")
        return " ".join(parts)

    def overrides(self) -> list[str]:
        """The `section.field=value` overrides that give a config this layout."""
        return [
            f"parallel.tensor_model_parallel_size={self.tp}",
            f"parallel.context_parallel_size={self.cp}",
            *([f'parallel.cp_comm_type="{self.cp_comm}"'] if self.cp > 1 else []),
            f"parallel.pipeline_model_parallel_size={self.pp}",
            f"parallel.virtual_pipeline_model_parallel_size={self.vpp if self.vpp > 1 else 'none'}",
            "parallel.pipeline_schedule=" + (f'"{self.schedule}"' if self.pp > 1 else "none"),
            "parallel.pipeline_model_parallel_layout="
            + ("none" if self.pipeline_layout is None else f'"{self.pipeline_layout}"'),
            f"parallel.sequence_parallel={str(self.sequence_parallel).lower()}",
            # a config's parallel.tp_comm_overlap needs sequence parallelism (apply_layout)
            *([] if self.sequence_parallel else ["parallel.tp_comm_overlap=false"]),
            f"parallel.use_distributed_optimizer={str(self.distributed_optimizer).lower()}",
            *(['parallel.data_parallel_sharding="full"'] if self.fsdp else []),
            *(
                [f"parallel.reduce_every_microbatch={str(self.reduce_every_microbatch).lower()}"]
                if self.fsdp and self.reduce_every_microbatch is not None
                else []
            ),
            *(
                [
                    f"parallel.expert_model_parallel_size={self.ep}",
                    f"parallel.expert_tensor_parallel_size={self.expert_tp}",
                ]
                if self.ep > 1 or self.etp is not None
                else []
            ),
            f"training.micro_batch_size={self.micro_batch}",
            f"model.recompute={self.recompute}",
        ]


def layout_of(config: Config, dp: int) -> Layout:
    """The layout a config runs at on tp x cp x pp x dp GPUs."""
    p = config.parallel
    vpp = p.virtual_pipeline_model_parallel_size or 1
    return Layout(
        tp=p.tensor_model_parallel_size,
        pp=p.pipeline_model_parallel_size,
        dp=dp,
        vpp=vpp,
        schedule=p.pipeline_schedule or ("interleaved" if vpp > 1 else "1f1b"),
        micro_batch=config.training.micro_batch_size,
        recompute=config.model.recompute,
        sequence_parallel=p.sequence_parallel and p.tensor_model_parallel_size > 1,
        distributed_optimizer=p.use_distributed_optimizer
        or p.data_parallel_sharding == "optimizer",
        cp=p.context_parallel_size,
        cp_comm=p.cp_comm_type if p.context_parallel_size > 1 else "p2p",
        fsdp=p.data_parallel_sharding == "full",
        ep=p.expert_model_parallel_size,
        etp=p.expert_tensor_parallel_size,
        reduce_every_microbatch=(
            True if p.data_parallel_sharding == "full" and p.reduce_every_microbatch else None
        ),
        pipeline_layout=layout_string(p.pipeline_model_parallel_layout),
    )


def layout_string(layout: str | list | None) -> str | None:
    """A pipeline layout as Megatron-LM's string (Megatron-Bridge's lists spelled in its
    letters), so a `Layout` stays hashable."""
    if layout is None or isinstance(layout, str):
        return layout
    return "|".join("".join(LAYOUT_NAMES[item] for item in stage) for stage in layout)


def balanced_pipeline_layout(num_layers: int, pp: int, vpp: int, mtp_num_layers: int = 0):
    """Megatron-Bridge's split of a model whose layers pp x vpp does not divide (its
    DeepSeek-V3 layouts): ceil(n / stages) layers a virtual stage, the last stage, which also
    holds the output layer, the loss and the MTP depths, the rest (at least one).  None when
    the stages divide the layers (the even split) or the rest would be under one."""
    stages = pp * vpp
    if pp == 1 or num_layers % stages == 0:
        return None
    each = -(-num_layers // stages)
    rest = num_layers - each * (stages - 1)
    if rest < 1:
        return None
    middle = f"(t*{each}|)*{stages - 2}" if stages > 2 else ""
    return f"Et*{each}|{middle}t*{rest}{'m' * (mtp_num_layers or 0)}L"


def apply_layout(config: Config, layout: Layout, global_batch: int | None = None) -> Config:
    """A copy of `config` at `layout` (and `global_batch`); the rest of the config kept."""
    p, t = config.parallel, config.training
    return replace(
        config,
        # a published run's recompute policy (RECOMPUTE_IMPLEMENTATIONS) as megatrain's nearest
        model=replace(
            config.model,
            recompute=RECOMPUTE_IMPLEMENTATIONS.get(layout.recompute, layout.recompute),
        ),
        parallel=replace(
            p,
            tensor_model_parallel_size=layout.tp,
            context_parallel_size=layout.cp,
            cp_comm_type=layout.cp_comm if layout.cp > 1 else p.cp_comm_type,
            pipeline_model_parallel_size=layout.pp,
            virtual_pipeline_model_parallel_size=layout.vpp if layout.vpp > 1 else None,
            pipeline_schedule=layout.schedule if layout.pp > 1 else None,
            pipeline_model_parallel_layout=layout.pipeline_layout,
            data_parallel_size=layout.dp,
            sequence_parallel=layout.sequence_parallel,
            # the config's choice where the layout has sequence parallelism to overlap
            tp_comm_overlap=p.tp_comm_overlap and layout.sequence_parallel,
            use_distributed_optimizer=layout.distributed_optimizer,
            data_parallel_sharding=layout.sharding,
            reshard_after_forward=p.reshard_after_forward if layout.fsdp else None,
            reduce_every_microbatch=layout.fsdp
            and (
                p.reduce_every_microbatch
                if layout.reduce_every_microbatch is None
                else layout.reduce_every_microbatch
            ),
            overlap_param_gather=p.overlap_param_gather and layout.distributed_optimizer,
            distribute_saved_activations=p.distribute_saved_activations
            and not layout.sequence_parallel,
            expert_model_parallel_size=layout.ep,
            expert_tensor_parallel_size=layout.etp,
        ),
        training=replace(
            t,
            micro_batch_size=layout.micro_batch,
            global_batch_size=global_batch or t.global_batch_size,
        ),
    )
