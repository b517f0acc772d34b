"""`remat.compat`: the supported range it states is the one pyproject.toml declares and the
installed torch lies in it; version strings parse as pip and CUDA builds write them."""

from __future__ import annotations

import re
from pathlib import Path

from remat import compat


def test_pyproject_declares_the_supported_range():
    text = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
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
