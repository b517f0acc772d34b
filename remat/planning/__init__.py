"""Planning: the budget and the settings a plan is made under, the planner that turns a
joint graph into a plan (`planner.Partitioner`), the floor a refusal names, the fused
recompute pass under inductor, one plan per input shape, and one plan on every rank."""
