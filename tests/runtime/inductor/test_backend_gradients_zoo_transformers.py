"""Every parameter's gradient through `remat.backend` with inductor equals eager's on the
zoo's transformers (`nets.train_zoo_model_through_the_backend`; the other zoo models,
and why the sizes and modes are what they are, in test_backend_gradients_zoo.py)."""

from __future__ import annotations

import pytest

from nets import PLANS, train_zoo_model_through_the_backend
from remat.testing import zoo

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py

TRANSFORMERS = ("gpt2", "llama", "bert", "vit")


def test_the_two_files_cover_the_zoo():
    from test_backend_gradients_zoo import test_zoo_models_train_as_eager_through_the_backend as others

    (marker,) = [m for m in others.pytestmark if m.name == "parametrize" and m.args[0] == "name"]
    assert sorted([*marker.args[1], *TRANSFORMERS]) == sorted(zoo.NAMES)


@pytest.mark.parametrize("plan", list(PLANS))
@pytest.mark.parametrize("name", TRANSFORMERS)
def test_zoo_transformers_train_as_eager_through_the_backend(name, plan):
    train_zoo_model_through_the_backend(name, plan)
