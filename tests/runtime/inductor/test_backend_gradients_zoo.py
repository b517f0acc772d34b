"""Every parameter's gradient through `remat.backend` with inductor equals eager's on every
zoo model, with nothing recomputed and with everything recomputed (`nets.PLANS`;
`test_backend_gradients.py` has the why and the tolerance).

Dropout is off (eval mode): inductor draws other random numbers than eager. Batch norm
(cnn, resnet) stays in training mode: eval would fold it into a fixed affine and leave
untested the batch statistics, their backward and the running-stat update that
recomputation must not repeat.

The models are the zoo's "micro" size (one layer per transformer, two blocks or stages
elsewhere). One step compiles each graph several times (remat's closed loop has inductor
generate the code of each plan it tries, to read its peak, then the final compile), so a
model and plan take 5-45 CPU-seconds and the file several minutes; a compile's time
follows the graph's node count, hence the smallest models. The transformers are in
test_backend_gradients_zoo_transformers.py, so that `pytest -n 2 --dist loadfile` runs
the two halves on two workers. CI runs both on the pinned torch only (neither is listed
in `conftest.TORCH_API_FILES`)."""

from __future__ import annotations

import pytest

from nets import PLANS, train_zoo_model_through_the_backend

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


@pytest.mark.parametrize("plan", list(PLANS))
@pytest.mark.parametrize("name", ["mlp", "cnn", "resnet"])
def test_zoo_models_train_as_eager_through_the_backend(name, plan):
    train_zoo_model_through_the_backend(name, plan)
