"""`megatrain plan`: choose tp, cp (context parallelism and its communication), pp, vpp, dp,
micro batch, recompute, sequence parallelism, the data-parallel sharding and a mixture of
experts' layout for a model and a cluster before running it.

- accounting/: every count from a config alone (parameters, FLOPs, bytes of state and of
  activations), which MFU logging counts with too;
- hardware.py: the GPU table (gpus.toml) and the time model's profiles, one per GPU
  generation (a `Profile`), or a measured one from a file;
- memory.py: the memory per GPU of a config (accounting's counts added up per pipeline
  stage) and the cheapest recompute that fits a GPU;
- layout.py: a layout (tp, cp, pp, dp, ..., the shardings) and a config at it;
- costs.py: the time model's primitives on one GPU (a GEMM, a flash kernel, memory-bound
  passes, a collective) and a group's bandwidth;
- attention_time.py: the attention core's time as its kernel runs, and context
  parallelism's communication around it;
- cost_model.py: memory (memory.py) and step time of one layout (its layers, pipeline,
  data-parallel communication and optimizer);
- search.py: every valid layout, ranked, with why the others are out;
- calibrate.py: a profile measured on the machine at hand;
- validation.py: the paper's scaling results the volta profile is fitted to;
- published.py: public training runs (published_runs.toml) and the plan's number for each,
  which `benchmarks/bench_plan.py --published` sets side by side and the plan summarizes for
  its GPU's generation;
- report.py: the plan as text or JSON.

The package imports nothing here, so megatrain.plan.accounting and megatrain.plan.memory (and
what imports them) do without importing the planner.
"""
