"""Hypothesis profiles: "dev" (default) and "ci" (derandomized), picked by the CI env var;
the `one_thread` fixture."""

import os

import pytest
from hypothesis import HealthCheck, settings

# deadline=None: simulate's timing varies with machine load; examples are bounded by
# max_examples on each test instead.
settings.register_profile("dev", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile(
    "ci", deadline=None, derandomize=True, print_blob=True, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile("ci" if os.environ.get("CI") else "dev")


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models run far faster on one intra-op thread: on a loaded 2-core machine a
    64x64 matmul took 20 ms with 2 OpenMP threads and 3 us with 1 (measured). A module
    uses it with `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    import torch  # here, not at import: the solver tests never need torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def _no_dp_table_cache(monkeypatch):
    """dp's block tables stay off disk in tests (REMAT_DP_TABLE_CACHE=0): tests must build
    what they check, and must not fill or read the user's ~/.cache/remat.
    tests/solver/test_dp_table_cache.py turns it on under tmp_path."""
    monkeypatch.setenv("REMAT_DP_TABLE_CACHE", "0")


TORCH_API_FILES = frozenset({
    # inductor: the partitioner hook, scheduler passes, generated-code estimate, caches
    "test_backend.py", "test_backend_gradients.py", "test_backend_inductor.py", "test_fusion_peak_guard.py",
    "test_inductor_budget.py", "test_inductor_extern_calls.py", "test_inductor_inlined_floor.py",
    "test_inductor_layout.py", "test_inductor_margin.py", "test_inductor_percentages.py", "test_inductor_random.py",
    "test_inductor_forward_strides.py", "test_inductor_saved_views.py", "test_offload_inductor.py", "test_outputs.py",
    "test_shared_storage.py",
    # not test_inductor_refusal.py (ResNet's refusal, 2-4.5 min a torch): the lowering it
    # meets is test_inductor_layout.py's and test_inductor_forward_strides.py's, the
    # refusal test_inductor_percentages.py's, on every torch
    # torch.distributed: DDP's optimizer, FSDP2's internals (remat.runtime.step.fsdp)
    "test_distributed.py", "test_ddp_buckets.py",
    # AOTAutograd tracing and fake tensors: random ops, meta-device values, symbolic sizes
    "test_random_signatures.py", "test_rng_replay.py", "test_cuda_values.py", "test_shapes.py",
    "test_compat.py",
    # AOTAutograd's joint graph under inductor's decompositions, read op by op
    "test_inlining.py",
})
"""Test files that touch an API of torch's that differs between supported versions
(`remat.compat`): CI runs them (`-m torch_api`) on the oldest and the newest torch
besides the whole suite on the pinned one."""


SLOWEST_FILES = (
    "test_backend_gradients_zoo_transformers.py", "test_inductor_refusal.py", "test_distributed.py",
    "test_backend_gradients_zoo.py", "test_inductor_layout.py", "test_compositions.py",
    "test_inductor_percentages.py", "test_ilp.py", "test_models.py", "test_backend_gradients.py",
    "test_inductor_inlined_floor.py", "test_inductor_saved_views.py", "test_random_signatures.py", "test_dp.py",
)
"""The test files that take longest (`--durations`, 2 workers), run first: with
`--dist loadfile` each worker takes one file at a time in this order
(`--no-loadscope-reorder` in pyproject.toml), so a long file left to the end cannot
keep one worker busy while the other has nothing left. The order changes no result."""


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.name in TORCH_API_FILES:
            item.add_marker(pytest.mark.torch_api)
    first = {name: rank for rank, name in enumerate(SLOWEST_FILES)}
    items.sort(key=lambda item: first.get(item.path.name, len(first)))  # stable: the rest as collected

