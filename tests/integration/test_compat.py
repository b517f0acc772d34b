"""`remat.compat`: the supported range it states is the one pyproject.toml declares and the
installed torch lies in it; version strings parse as pip and CUDA builds write them; no
other module of remat reaches into a private part of torch, and each private name compat
hands out resolves on the installed torch and has its row in compat's table."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from remat import compat


def test_pyproject_declares_the_supported_range():
    text = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
    low, high = re.search(r'"torch>=(\d+\.\d+),<(\d+\.\d+)"', text).groups()
    (oldest, newest) = compat.SUPPORTED
    assert compat.torch_version(low) == oldest
    assert compat.torch_version(high) == (newest[0], newest[1] + 1)


def test_the_installed_torch_is_supported():
    oldest, newest = compat.SUPPORTED
    assert oldest <= compat.torch_version() <= newest


def test_versions_parse_with_local_suffixes():
    assert compat.torch_version("2.11.0+cu130") == (2, 11)
    assert compat.torch_version("2.14.1") == (2, 14)
    assert compat.torch_version("2.13.0+cpu") == (2, 13)


REMAT = Path(__file__).resolve().parents[2] / "remat"

ALLOWED_PRIVATE = {
    "torch.utils._pytree": "the same tree_flatten/tree_map/tree_leaves in torch 2.11-2.14, which "
                           "torch's public APIs use as if public; torch has no public pytree module",
}
"""Private torch modules any module of remat may import, each with its reason."""


def _private_parts(dotted: str) -> bool:
    """Whether a dotted torch name reaches a private or experimental part of torch
    (`torch.ops.*` are operator names, not torch's Python API)."""
    parts = dotted.split(".")
    if parts[0] != "torch" or parts[1:2] == ["ops"] or any(dotted == a or dotted.startswith(a + ".")
                                                           for a in ALLOWED_PRIVATE):
        return False
    return "experimental" in parts or any(p.startswith("_") and not p.startswith("__") for p in parts)


def private_torch_uses(source: str) -> list[tuple[int, str]]:
    """(line, dotted name) of every import of, or attribute path into, a private part of
    torch in `source`; docstrings, comments and strings do not count."""
    import ast

    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if _private_parts(a.name)]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = (node.module, *(f"{node.module}.{a.name}" for a in node.names))
            found += [(node.lineno, n) for n in names if _private_parts(n)][:1]
        elif isinstance(node, ast.Attribute):
            chain, base = [node.attr], node.value
            while isinstance(base, ast.Attribute):
                chain.append(base.attr)
                base = base.value
            if isinstance(base, ast.Name) and base.id == "torch":
                dotted = ".".join(["torch", *reversed(chain)])
                if _private_parts(dotted):
                    found.append((node.lineno, dotted))
    return found


def test_private_torch_names_go_through_compat():
    """Every private torch name remat uses is one of `remat.compat`'s (its table says which
    torch has it and what remat does without it); `solvers/` imports no torch at all."""
    offenders = []
    for path in sorted(REMAT.rglob("*.py")):
        if path.name == "compat.py" and path.parent == REMAT:
            continue
        uses = private_torch_uses(path.read_text())
        # an attribute chain is also reported once per prefix: keep the longest per line
        longest = {line: name for line, name in sorted(uses, key=lambda u: len(u[1]))}
        offenders += [f"{path.relative_to(REMAT.parent)}:{line}: {name}" for line, name in sorted(longest.items())]
    assert not offenders, "import these through remat.compat:\n" + "\n".join(offenders)


def test_the_check_sees_private_names():
    source = ("import torch\nimport torch._dynamo\nfrom torch._inductor import config\n"
              "from torch import _guards\nfrom torch.fx.experimental.symbolic_shapes import free_symbols\n"
              "x = torch._C.DispatchKey\ny = torch.UntypedStorage._expired\n"
              "'''torch._inductor in a docstring'''\nz = torch.ops.aten._to_copy.default\n"
              "from torch.utils._pytree import tree_leaves\nfrom torch.fx import GraphModule\n")
    lines = sorted({line for line, _ in private_torch_uses(source)})
    assert lines == [2, 3, 4, 5, 6, 7]


def test_every_private_name_resolves_and_is_in_the_table():
    for name, (api, _) in compat._PRIVATE.items():
        assert getattr(compat, name) is not None
        module, _, attribute = api.partition(":")
        assert f"| `{name}` | `{module}{'.' + attribute if attribute else ''}" in compat.__doc__, name


def test_a_missing_private_name_names_the_feature(monkeypatch):
    from remat.errors import RematError, UnsupportedTorchError

    monkeypatch.setitem(compat._PRIVATE, "gone", ("torch._inductor.config:no_such_option", "a feature"))
    with pytest.raises(UnsupportedTorchError) as e:
        from remat.compat import gone  # noqa: F401
    assert isinstance(e.value, RematError) and isinstance(e.value, ImportError)
    assert "a feature needs torch's `torch._inductor.config.no_such_option`" in str(e.value)
    assert torch.__version__ in str(e.value)
