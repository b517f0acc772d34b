"""Every parameter's gradient through `remat.backend` with inductor equals eager's on zoo
models (`test_backend_gradients.py` has the why and the tolerance). One inductor compile
here takes 35-50 s, so CI runs this file on the pinned torch only (it is not listed in
`conftest.TORCH_API_FILES`)."""

from __future__ import annotations

import pytest
import torch

import remat
from remat.testing import zoo
from nets import PLANS, assert_gradients_match

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


@pytest.mark.parametrize("plan", list(PLANS))
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_zoo_models_train_as_eager_through_the_backend(name, plan):
    torch._dynamo.reset()
    case = zoo.build(name, size="tiny")
    case.model.eval()  # dropout off: inductor draws other random numbers than eager
    with torch.no_grad():  # transformers settles `config.problem_type` on the first call
        case.model(*case.args, **case.kwargs)
    be = remat.backend(**PLANS[plan])
    compiled = torch.compile(case.model, backend=be)
    assert_gradients_match(case.model, lambda m: compiled(*case.args, **case.kwargs).loss,
                           lambda m: m(*case.args, **case.kwargs).loss, f"{name}, {plan}")
