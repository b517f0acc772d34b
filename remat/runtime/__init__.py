"""Runtime side of the pipeline: turn a plan into forward and backward GraphModules
(`rewrite`, with `rng` replay and `offload`/`offload_ops` for host copies) and run them,
eagerly or as a `torch.compile` backend (`backend`). Rooms: `inductor/` (the budget under
inductor's fusion, plans kept for cache hits) and `step/` (one budget for a whole step
split across graphs)."""
