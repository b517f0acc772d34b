"""The `ilp` solver's room: an exact CP-SAT model, certified by simulate.

data.py turns a problem into node-step arrays (the bytes every plan holds, the runs of a
value's uses); model.py builds the canonical CP-SAT model from them; solver.py runs
OR-Tools under deterministic limits and returns the certified plan (`solve_ilp`,
registered as "ilp").
"""
