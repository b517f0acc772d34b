"""Planning: the settings a plan is made under, the floor a refusal names (and the
lowest plan found), the fused recompute pass under inductor, one plan per input shape,
and one plan on every rank. `remat.partitioner` joins them with the front end and the
rewrite."""
