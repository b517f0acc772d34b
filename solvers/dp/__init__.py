"""The `dp` solver's room: exact dynamic programming over block sequences.

structure.py finds the blocks (articulation points of the problem's graph) and the bytes
no decision changes; local.py replays one block's canonical schedule for a configuration;
fronts.py keeps the Pareto fronts the DP carries between blocks; solver.py is the solver
(`solve_dp`, registered as "dp", and reused by "layered").
"""
