"""Where one rank sits in the layout, as the model sees it (`ParallelContext`), and the rank's
chunks of a model built for it (`build_chunks`).

The model classes compute one chunk of the transformer; the layout reaches them as a
`ParallelContext`, never by reading or changing process-group globals.  What parallelism
then does to the built chunks (recompute, context and expert parallelism, compile, FSDP,
CUDA graphs) is `megatrain.parallelize`'s.
"""

from dataclasses import dataclass

import torch

from megacore import parallel_state, pipeline_parallel


@dataclass(frozen=True)
class ParallelContext:
    """Where one rank sits in the layout: its tensor- and pipeline-parallel rank and size, the
    virtual pipeline size (None: no interleaving), and in the expert layout its
    expert-parallel rank and size (which experts it holds) and expert-tensor-parallel rank
    and size (which slice of each)."""

    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    vpp_size: int | None = None
    ep_rank: int = 0
    ep_size: int = 1
    etp_rank: int = 0
    etp_size: int = 1

    @classmethod
    def from_process_groups(cls) -> "ParallelContext":
        """This rank's place as megacore's process groups say (one process when none are set
        up)."""
        if not parallel_state.model_parallel_is_initialized():
            return cls()
        return cls(
            tp_rank=parallel_state.get_tensor_model_parallel_rank(),
            tp_size=parallel_state.get_tensor_model_parallel_world_size(),
            pp_rank=parallel_state.get_pipeline_model_parallel_rank(),
            pp_size=parallel_state.get_pipeline_model_parallel_world_size(),
            vpp_size=parallel_state.get_virtual_pipeline_model_parallel_world_size(),
            ep_rank=parallel_state.get_expert_model_parallel_rank(),
            ep_size=parallel_state.get_expert_model_parallel_world_size(),
            etp_rank=parallel_state.get_expert_tensor_parallel_rank(),
            etp_size=parallel_state.get_expert_tensor_parallel_world_size(),
        )

    def chunk_places(
        self, num_layers: int, stage_layers: tuple[int, ...] | None = None
    ) -> list[tuple[list[int], bool, bool]]:
        """Per chunk of this rank (one, or vpp_size under interleaving): its layer ids, whether
        it holds the embeddings (the very first chunk of the model) and whether it holds the
        output (the very last).  `stage_layers`: the layers of every virtual stage
        (TransformerConfig.pipeline_layer_counts; None: the even split)."""
        virtual = self.vpp_size or 1
        return [
            (
                pipeline_parallel.layers_for(
                    num_layers,
                    self.pp_rank,
                    self.pp_size,
                    self.vpp_size,
                    virtual_rank=v,
                    stage_layers=stage_layers,
                ),
                self.pp_rank == 0 and v == 0,
                self.pp_rank == self.pp_size - 1 and v == virtual - 1,
            )
            for v in range(virtual)
        ]


def build_chunks(
    model_class: type,
    cfg,
    seed: int = 1234,
    parallel: ParallelContext | None = None,
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
    initialize: bool = True,
) -> list:
    """This rank's chunks of a `LanguageModel` (one, or vpp under interleaving), tied
    embeddings synced.

    Built directly on `device` (the CPU when None) in `dtype`, so the sync, a collective
    over the embedding group, runs where the parameters stay (NCCL needs them on the GPU).
    `initialize=False`: no weights drawn, for a model a checkpoint is about to fill.
    `parallel`: where this rank sits (None: read from megacore's process groups, which
    `initialize_model_parallel` must then have set up).  Each chunk is told its place; no
    global state is read by the model or changed here.  The chunks are as built:
    `megatrain.parallelize.parallelize_model` applies recompute, context and expert
    parallelism and the rest to them.
    """
    parallel = parallel or ParallelContext.from_process_groups()
    chunks = [
        model_class(
            cfg,
            layer_ids,
            pre_process=first,
            post_process=last,
            seed=seed,
            device=device,
            dtype=dtype,
            initialize=initialize,
            parallel=parallel,
        )
        for layer_ids, first, last in parallel.chunk_places(
            cfg.num_layers, cfg.pipeline_layer_counts
        )
    ]
    pipeline_parallel.sync_shared_embeddings(chunks)
    return chunks
