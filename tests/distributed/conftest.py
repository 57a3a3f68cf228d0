"""The Ray instance of a distributed test module: started by the test itself, never an outside cluster's."""

from collections.abc import Iterator
from typing import Any

import pytest

from userrl_megatron.config.schema import RunConfig
from userrl_megatron.fleet.placement import start_ray


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[Any]:
    """A local Ray with 4 logical CPUs (the pool tests place up to 4 engine actors), shut down after the module."""
    import ray

    start_ray(RunConfig(), num_cpus=4)
    yield ray
    ray.shutdown()
