"""Offload to host memory, in one room: what it costs and when the planner may use it
(`costing`: the link's bandwidth, the offload floor, the hint a refusal gives), and how
a plan's offloads run (`host`: pinned host copies inserted into the rewritten graphs;
`ops`: the same as torch.library ops, for graphs inductor compiles)."""
