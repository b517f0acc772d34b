"""The whole-step room of the runtime: one budget across the graphs dynamo makes of a step
(graph breaks, DDPOptimizer buckets, FSDP2's per-module graphs). ledger.py records what
each graph call holds and what lives outside it; split.py divides the budget among the
calls; graph.py wraps each compiled graph so it plans under its share; fsdp.py counts
what FSDP2 holds outside every graph (sharded parameters and gradients, buffers);
storages.py keys storages by int, with a weak reference only where one must be watched."""
