"""The `dp` solver's room: exact dynamic programming over block sequences.

structure.py finds the blocks (articulation points of the problem's graph) and the bytes
no decision changes; configs.py enumerates a block's configurations; local.py replays one
block's canonical schedule for a configuration (its steps: steps.py); tables.py builds,
shares and caches the per-block tables of evaluated options (on disk: table_cache.py);
fronts.py keeps the Pareto fronts the DP carries between blocks; solver.py is the solver
(`solve_dp`, registered as "dp", and reused by "layers").
"""
