"""Repeated layers of a traced joint graph, from the `nn_module_stack` of its forward nodes.

The layers are the children `<prefix>.0`, `<prefix>.1`, ... of one container (a
ModuleList such as GPT-2's `transformer.h` or LLaMA's `model.layers`): of the prefixes
that number two or more children, the one whose children ran the most forward nodes.
The result is torch-free data (`remat_solvers.layer_structure.LayerStructure`) handed to solvers in
`Problem.layers`; None when no such container exists or its layers do not run one after
the other.
"""

from __future__ import annotations

import logging
import re
from collections import Counter

from torch import fx

from remat.frontend.problem import GraphProblem
from remat_solvers.layer_structure import OUTSIDE, LayerStructure

log = logging.getLogger(__name__)

_NUMBERED = re.compile(r"^(.*)\.(\d+)$")


def _numbered_paths(node: fx.Node) -> list[tuple[str, int]]:
    """(container prefix, child index) for each numbered module the node ran in."""
    stack = node.meta.get("nn_module_stack") or {}
    out = []
    for entry in stack.values():
        path = entry[0] if isinstance(entry, tuple) else str(entry)
        m = _NUMBERED.match(path)
        if m:
            out.append((m.group(1), int(m.group(2))))
    return out


def layer_structure(joint: fx.GraphModule, graph_problem: GraphProblem) -> LayerStructure | None:
    """The repeated layers of `joint`'s forward nodes, or None."""
    problem = graph_problem.problem
    by_name = {n.name: n for n in joint.graph.nodes}
    paths: dict[int, list[tuple[str, int]]] = {}
    count: Counter[str] = Counter()
    children: dict[str, set[int]] = {}
    for i in problem.forward_ids:
        names = graph_problem.fx_names[i]  # none: FORWARD_END, no fx node
        node = by_name.get(names[0]) if names else None
        found = _numbered_paths(node) if node is not None else []
        paths[i] = found
        for prefix, k in dict.fromkeys(found):
            count[prefix] += 1
            children.setdefault(prefix, set()).add(k)
    candidates = [p for p in count if len(children[p]) >= 2]
    if not candidates:
        return None
    prefix = max(candidates, key=lambda p: (count[p], p))
    order = sorted(children[prefix])
    ordinal = {k: n for n, k in enumerate(order)}
    layer_of = [OUTSIDE] * len(problem.nodes)
    for i, found in paths.items():
        for p, k in found:
            if p == prefix:
                layer_of[i] = ordinal[k]
                break
    names = tuple(f"{prefix}.{k}" for k in order)
    try:
        return LayerStructure(layer_of=tuple(layer_of), names=names)
    except ValueError as error:  # layers interleave: no stack to solve layer by layer
        log.info("remat: %s children do not run one after the other (%s); no layer structure", prefix, error)
        return None

