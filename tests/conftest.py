"""Hypothesis profiles: "dev" (default) and "ci" (derandomized), picked by the CI env var."""

import os

from hypothesis import HealthCheck, settings

# deadline=None: simulate's timing varies with machine load; examples are bounded by
# max_examples on each test instead.
settings.register_profile("dev", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile(
    "ci", deadline=None, derandomize=True, print_blob=True, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile("ci" if os.environ.get("CI") else "dev")
