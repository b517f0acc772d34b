"""Runtime side of the pipeline: turn a plan into forward and backward GraphModules
(`rewrite`, with `rng` replay and `schedule` for values recomputed twice; host copies
come from `remat.offload`) and run them. Rooms: `inductor/` (the budget under inductor's
fusion, plans kept for cache hits) and `step/` (one budget for a whole step split across
graphs)."""
