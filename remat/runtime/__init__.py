"""Runtime side of the pipeline: turn a plan into forward and backward GraphModules
(`rewrite`) and run them, eagerly or as a `torch.compile` backend (`backend`)."""
