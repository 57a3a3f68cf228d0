import os

import pytest

from userrl_megatron.config import MegatronConfig, RolloutConfig
from userrl_megatron.fleet.placement import plan_bundles


@pytest.mark.distributed
def test_ray_placement_pins_actors_to_their_bundles() -> None:
    import ray

    from userrl_megatron.config import RunConfig
    from userrl_megatron.fleet.placement import create_placement, start_ray

    start_ray(RunConfig(), num_cpus=3)
    try:
        placement = create_placement(
            plan_bundles(MegatronConfig(devices_per_node=2), RolloutConfig(num_engines=1), use_gpu=False)
        )

        @ray.remote
        class Where:
            def group(self) -> str | None:
                return ray.get_runtime_context().get_placement_group_id()

            def niceness(self) -> int:
                return os.nice(0)

        actors = [Where.options(**placement.actor_options(r)).remote() for r in range(2)]
        engine = Where.options(**placement.engine_options(0)).remote()
        groups = ray.get([a.group.remote() for a in actors] + [engine.group.remote()])
        assert groups == [placement.group.id.hex()] * 3
        # at the driver's priority, not Ray's default of 15 nice levels below it (RAY_ENVIRONMENT)
        assert ray.get([a.niceness.remote() for a in [*actors, engine]]) == [os.nice(0)] * 3
        assert sorted(placement.plan.actor_bundles + placement.plan.engine_bundles) == [0, 1, 2]
    finally:
        ray.shutdown()


@pytest.mark.distributed
def test_a_run_never_attaches_to_a_cluster_it_was_not_given(tmp_path, monkeypatch) -> None:
    """With a Ray head already up on the machine (and RAY_ADDRESS exported, as a SLURM job does), an empty
    `run.ray_address` starts a private instance with its own resources; naming the head joins it instead."""
    import os
    import shutil
    import signal
    import socket
    import subprocess
    import sys
    import tempfile
    import time
    from pathlib import Path

    import ray

    from userrl_megatron.config import RunConfig
    from userrl_megatron.fleet.placement import start_ray

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    address = f"127.0.0.1:{port}"
    temp_dir = tempfile.mkdtemp(prefix="ray")  # Ray's socket paths must stay under 108 bytes
    command = [str(Path(sys.executable).parent / "ray"), "start", "--head", "--block", f"--port={port}"]
    command += ["--num-cpus=7", "--node-ip-address=127.0.0.1", "--include-dashboard=false", f"--temp-dir={temp_dir}"]
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    log = tmp_path / "head.log"
    with log.open("w") as out:
        head = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT, process_group=0)
    try:
        deadline = time.monotonic() + 600  # a bound on the head's start-up, not a timing assertion
        while "Ray runtime started" not in log.read_text():  # poll the head's log
            assert head.poll() is None and time.monotonic() < deadline, f"no Ray head:\n{log.read_text()}"
            time.sleep(0.5)
        monkeypatch.setenv("RAY_ADDRESS", address)
        start_ray(RunConfig(), num_cpus=3)
        assert ray.cluster_resources()["CPU"] == 3  # a private instance, not the 7-CPU head
        ray.shutdown()
        monkeypatch.delenv("RAY_ADDRESS")
        start_ray(RunConfig(ray_address=address), num_cpus=3)  # joining passes no resource count
        assert ray.cluster_resources()["CPU"] == 7
    finally:
        ray.shutdown()
        if head.poll() is None:
            os.killpg(head.pid, signal.SIGTERM)  # `ray start --block` stops its processes on SIGTERM
            head.wait(timeout=600)
        shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.mark.distributed
def test_engines_that_do_not_fit_beside_the_simulators_fail_at_once() -> None:
    """`userrl rollout` and `userrl eval` place the user simulator's engines first: policy engines that need more
    than those left free fail in one line, not after the reservation's wait (which only a hang may reach here)."""
    import ray

    from userrl_megatron.config import RunConfig
    from userrl_megatron.fleet.placement import PlacementError, create_placement, start_ray

    engines_only = MegatronConfig(nnodes=1, devices_per_node=0)
    start_ray(RunConfig(), num_cpus=3)
    try:
        simulator = create_placement(plan_bundles(engines_only, RolloutConfig(num_engines=2), use_gpu=False))
        policy = plan_bundles(engines_only, RolloutConfig(num_engines=2), use_gpu=False)
        with pytest.raises(PlacementError) as failure:
            create_placement(policy, timeout_s=600.0, beside="the user simulator's engines")
        assert str(failure.value) == (
            "the run needs 2 CPUs (2 bundles of CPU 1) and the Ray cluster has 1 free beside the user simulator's "
            "engines"
        )
        ray.util.remove_placement_group(simulator.group)
        one = create_placement(plan_bundles(engines_only, RolloutConfig(num_engines=1), use_gpu=False), beside="x")
        assert len(one.slots) == 1  # what fits beside them is placed
    finally:
        ray.shutdown()
