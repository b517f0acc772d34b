"""What the trace of a CUDA step holds that a CPU one does not, tested on CPU: values whose
device the trace does not know (`frontend.profile.made_at_run`), and the caching
allocator's block rounding.

SDPA's fused CUDA kernels return their Philox seed and offset as host tensors, yet
fake tensors trace them on the GPU. Their backward kernels dereference the seed's
pointer on the host, so a GPU stand-in (built to measure the backward's workspace, or
reloaded after an offload) is a segmentation fault: it was, on an H200. Traced here on
fake CUDA tensors, no GPU needed. A custom op whose fake returns a meta seed stands in
for the same at run time: its backward reads the host seed, and offloading that seed
made the backward reload it onto "meta" and write through its null storage. Neither
happens: such a seed is never offloaded, and ops reading it are not run for their
workspace."""

from __future__ import annotations

import copy
import operator

import pytest
import torch

import remat
from remat.frontend import workspace
from remat_solvers import Decision

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


@torch.library.custom_op("remat_test::seeded_double", mutates_args=())
def seeded_double(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x * 2, torch.tensor(5, dtype=torch.long)


@seeded_double.register_fake
def _(x):
    return torch.empty_like(x), torch.empty((), dtype=torch.long, device="meta")


@torch.library.custom_op("remat_test::seeded_double_backward", mutates_args=())
def seeded_double_backward(grad: torch.Tensor, seed: torch.Tensor) -> torch.Tensor:
    if seed.device.type != "cpu" or int(seed) != 5:
        raise RuntimeError(f"the seed came back wrong: {seed}")
    return grad * 2


@seeded_double_backward.register_fake
def _(grad, seed):
    return torch.empty_like(grad)


def _setup(ctx, inputs, output):
    ctx.save_for_backward(output[1])


def _backward(ctx, grad, _grad_seed):
    (seed,) = ctx.saved_tensors
    return seeded_double_backward(grad, seed)


seeded_double.register_autograd(_backward, setup_context=_setup)


class Seeded(torch.nn.Module):
    def __init__(self, depth: int = 4, d: int = 64):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(d, d) for _ in range(depth))

    def forward(self, x):
        for layer in self.layers:
            y, _seed = seeded_double(layer(x))
            x = y.tanh()
        return x.square().mean()


def _planned_at_the_offload_floor(model, x):
    with pytest.raises(remat.InfeasibleBudgetError) as refused:
        remat.plan(model, (x,), budget=1, offload=True)
    return remat.plan(model, (x,), budget=refused.value.min_peak_bytes, offload=True)


def test_a_seed_made_at_run_is_never_offloaded_and_the_step_trains_as_eager():
    torch.manual_seed(0)
    model, x = Seeded(), torch.randn(64, 64)
    eager = copy.deepcopy(model)
    planned = _planned_at_the_offload_floor(model, x)
    gp = planned.step.graph_problem
    offloaded = {gp.value_name[i] for i, d in planned.plan.decisions.items() if d is Decision.OFFLOAD}
    seeds = {n.name for n in planned.step.forward.graph.nodes
             if isinstance(n.meta.get("val"), torch.Tensor) and n.meta["val"].device.type == "meta"}
    assert len(seeds) == 4 and not offloaded & seeds
    assert not any(gp.problem.nodes[gp.value_name.index(name)].offloadable for name in seeds)
    loss = planned(x)
    loss.backward()
    expected = eager(x)
    expected.backward()
    assert torch.equal(loss, expected)
    for a, b in zip(model.parameters(), eager.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)


def test_an_op_reading_a_seed_made_at_run_is_not_run_for_its_workspace(monkeypatch):
    ran = []
    real = workspace._run

    def spy(todo, device):
        ran.extend(node for _, node in todo)
        return real(todo, device)

    monkeypatch.setattr(workspace, "_run", spy)
    monkeypatch.setattr(workspace, "_CACHE", {})
    torch.manual_seed(0)
    model, x = Seeded(depth=1), torch.randn(64, 64)
    remat.plan(model, (x,), budget="100%", measure_workspace=True)
    targets = {node.target for node in ran}
    assert torch.ops.aten.addmm.default in targets  # the rest was measured
    assert torch.ops.remat_test.seeded_double_backward.default not in targets
    assert workspace.measure([n for n in ran[0].graph.nodes], torch.device("cpu")).get(
        "seeded_double_backward") == workspace.unmeasured_attention_bytes(
        next(n for n in ran[0].graph.nodes if n.name == "seeded_double_backward")) == 64 * 64 * 4


def _attention_traced_on_fake_cuda():
    """A forward and backward through SDPA's efficient and flash kernels with dropout,
    traced on fake CUDA tensors."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    aten = torch.ops.aten

    def step(q):
        out = aten._scaled_dot_product_efficient_attention(q, q, q, None, True, 0.1, True)
        grads = aten._scaled_dot_product_efficient_attention_backward(
            out[0], q, q, q, None, out[0], out[1], out[2], out[3], 0.1, [True, True, True, False], True)
        flash = aten._scaled_dot_product_flash_attention(q.bfloat16(), q.bfloat16(), q.bfloat16(), 0.1, True)
        return grads[0], flash[0], flash[6], flash[7]

    with FakeTensorMode():
        return make_fx(step)(torch.empty(2, 4, 128, 32, device="cuda"))


def test_sdpa_philox_state_traced_on_cuda_is_made_at_run():
    from remat.frontend.profile import made_at_run

    graph = _attention_traced_on_fake_cuda().graph
    getitems = {(n.args[0].target, n.args[1]): n for n in graph.nodes if n.target is operator.getitem}
    efficient = torch.ops.aten._scaled_dot_product_efficient_attention.default
    flash = torch.ops.aten._scaled_dot_product_flash_attention.default
    seeds = {getitems[efficient, 2], getitems[efficient, 3], getitems[flash, 6], getitems[flash, 7]}
    assert all(tensor.meta["val"].device.type == "cuda" for tensor in seeds)  # what the trace says
    assert {n for n in getitems.values() if made_at_run(n, "cuda")} == seeds
    backward = next(n for n in graph.nodes if n.target is torch.ops.aten._scaled_dot_product_efficient_attention_backward.default)
    cuda = torch.device("cuda")
    assert workspace._reads_made_at_run(backward, cuda)
    assert not any(workspace._reads_made_at_run(n, cuda) for n in graph.nodes if n.target in (efficient, flash))


def test_cuda_storages_count_in_the_allocators_512_byte_blocks():
    """`torch.cuda.max_memory_allocated` counts the caching allocator's rounded blocks: a
    4-byte CUDA tensor takes 512 B; traced on fake CUDA tensors (no GPU needed)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from remat.frontend.profile import storage_bytes

    with FakeTensorMode():
        assert storage_bytes(torch.empty(1, device="cuda")) == 512
        assert storage_bytes(torch.empty(129, device="cuda")) == 1024  # 516 B
        assert storage_bytes(torch.empty(128, device="cuda")) == 512
        assert storage_bytes(torch.empty(0, device="cuda")) == 0
    assert storage_bytes(torch.empty(129)) == 516  # CPU: exact


class _Mlp(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(*[m for _ in range(4) for m in (torch.nn.Linear(64, 64), torch.nn.Tanh())])

    def forward(self, x):
        return self.body(x).square().mean()


def _mlp():
    torch.manual_seed(0)
    return _Mlp(), torch.randn(32, 64)


def _refused_floor(model, x) -> int:
    with pytest.raises(remat.InfeasibleBudgetError) as refused:
        remat.plan(model, (x,), budget=1, offload=False)
    return refused.value.min_peak_bytes


def test_the_cuda_libraries_workspaces_count_all_step(monkeypatch):
    """What the planner learns of the libraries' workspaces (measured on a GPU; given here)
    is one value live all step: every peak, the floor included, rises by exactly it."""
    import remat.partitioner
    from remat.frontend.problem import LIBRARY_WORKSPACES
    from remat_solvers import Phase

    held = 1 << 20
    model, x = _mlp()
    plain, plain_floor = remat.plan(model, (x,), budget="100%"), _refused_floor(model, x)
    monkeypatch.setattr(remat.partitioner, "library_workspace_bytes", lambda device: held)
    model, x = _mlp()
    planned, floor = remat.plan(model, (x,), budget="100%"), _refused_floor(model, x)
    assert planned.predicted_peak_bytes == plain.predicted_peak_bytes + held
    assert floor == plain_floor + held
    gp = planned.step.graph_problem
    node = gp.problem.nodes[gp.value_name.index(LIBRARY_WORKSPACES)]
    assert (node.phase, node.out_bytes, gp.fx_names[gp.value_name.index(LIBRARY_WORKSPACES)]) == (Phase.PARAM, held, ())
    eager, _ = _mlp()
    planned(x).backward()
    eager(x).backward()
    for a, b in zip(model.parameters(), eager.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)


@pytest.mark.parametrize(("capability", "environ", "expected"), [
    ((9, 0), {}, 2 * 32 * 2**20),  # Hopper: 32 MiB each for cuBLAS and cuBLASLt
    ((8, 0), {}, 2 * (4096 * 1024 * 2 + 16 * 1024 * 8)),
    ((9, 0), {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}, 2 * 4096 * 1024),
    ((9, 0), {"CUBLAS_WORKSPACE_CONFIG": ":4096:2:16:8"}, 2 * (4096 + 16) * 1024),
    ((9, 0), {"CUBLAS_WORKSPACE_CONFIG": ":16:8", "CUBLASLT_WORKSPACE_SIZE": "1024"}, 16 * 1024 + 2**20),
])
def test_the_configured_library_workspaces(capability, environ, expected):
    from remat.frontend.libraries import configured_bytes

    assert configured_bytes(capability, environ) == expected
