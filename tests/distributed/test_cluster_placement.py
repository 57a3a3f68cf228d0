"""Every shipped layout and example brought up on a simulated multi-node cluster: Ray's test cluster on this
machine (one raylet per node, 8 declared GPUs each; node k > 0 at 127.0.0.(k + 1)), through the trainer's own
placement and launch code with the actor ranks and engines dry (`trainer/dry_run.py`). What each process would
run is checked against expectations written out here: each actor rank's node, visible GPU, local rank, world
size, master address and parallel ranks; each engine process's node, environment and full command line; the
weight-sync groups; the router. A layout that cannot be placed fails in one line.

One cluster per node count (1, 2, 3, 4), started once for the tests that need it. Nothing here waits on time
except the guard against a hang (`HANG_S`)."""

import re
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from userrl_megatron.config import ConfigError, load_config
from userrl_megatron.errors import UserError
from userrl_megatron.fleet.pool import EngineProcess
from userrl_megatron.fleet.sglang import KEY_ENTRY
from userrl_megatron.trainer.dry_run import BringUp, bring_up, format_placement, simulated_cluster

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
HANG_S = 900.0  # a bring-up of 48 processes takes about a minute on 2 busy cores; only a hang reaches this
SGLANG_VENV = REPO / ".venv-sglang" / "bin" / "python"
PY = str(SGLANG_VENV) if SGLANG_VENV.is_file() else sys.executable  # the router's (it needs no GPU)
ENGINE_PY = sys.executable  # rollout.sglang.python "" for engines on GPUs: never the CPU .venv-sglang
DRIVER_NODE = 0


@pytest.fixture(scope="module")
def cluster(request: pytest.FixtureRequest) -> Iterator[list[str]]:
    """A simulated cluster of `request.param` nodes of 8 GPUs; yields their IPs, node 0 (the driver's) first."""
    with simulated_cluster(request.param, 8) as ips:
        yield ips


def up(config: str, *overrides: str) -> BringUp:
    """The dry bring-up of a config file (plus overrides) on the connected cluster, guarded against a hang."""
    cfg = load_config([str(REPO / config)], list(overrides))
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(bring_up, cfg).result(timeout=HANG_S)


def ranks(result: BringUp, ips: list[str]) -> list[tuple]:
    """(node, CUDA_VISIBLE_DEVICES, local rank, world size, device, backend, master, (tp, pp, cp, dp, ep)) per rank."""
    node = {ip: i for i, ip in enumerate(ips)}
    masters = {r.master_port for r in result.ranks}
    assert len(masters) == 1 and 0 < masters.pop() < 65536  # one master port, a real one
    rows = []
    for r in result.ranks:
        p = r.parallel
        coords = (p["tp_rank"], p["pp_rank"], p["cp_rank"], p["dp_rank"], p["ep_rank"])
        rows.append(
            (node[r.ip], r.visible_devices, r.local_rank, r.world_size, r.device, r.backend, r.master_addr, coords)
        )
    assert [r.rank for r in result.ranks] == list(range(len(rows)))
    return rows


def command_of(process: EngineProcess) -> list[str]:
    """The process's command line without `--nccl-port N`, which the pool draws per run (`rendezvous` checks it)."""
    command = list(process.launch.command)
    if "--nccl-port" not in command:
        return command
    at = command.index("--nccl-port")
    return command[:at] + command[at + 2 :]


def rendezvous(result: BringUp) -> None:
    """Every SGLang process, the user simulator's included, has its own `--nccl-port` on its node: the pool hands
    each engine ports of its own (`fleet/engine_ports.py`)."""
    holders: dict[tuple[str, int], set[tuple[str, int]]] = {}
    for kind, processes in (("policy", result.engines), ("simulator", result.simulator)):
        for e in processes:
            command = e.launch.command
            if "sglang.launch_server" in command:
                port = int(command[command.index("--nccl-port") + 1])
                holders.setdefault((e.ip, port), set()).add((kind, e.engine))
    assert all(len(engines) == 1 for engines in holders.values()), holders


def engines(result: BringUp, ips: list[str]) -> list[tuple]:
    """(engine, node, node rank, env, URL, command) per engine process, the watchdog left out (all are watched), and
    `--nccl-port N` left out of the command once `rendezvous` checked it."""
    node = {ip: i for i, ip in enumerate(ips)}
    assert all(e.launch.watch for e in result.engines)
    rendezvous(result)
    return [(e.engine, node[e.ip], e.node_rank, e.launch.env, e.launch.url, command_of(e)) for e in result.engines]


# rollout.sglang.release_cuda_graph: the engine's CUDA-graph pool leaves the GPU while the actor trains.
GRAPHS_ENV = {"SGLANG_MEMORY_SAVER_CUDA_GRAPH": "1"}
# The user simulator's engines write JSON without free whitespace (`user_sim.engines`: its replies are schema-bound).
TIGHT_JSON = ["--constrained-json-disable-any-whitespace"]


def sglang(model: str, port: int, tp: int, mem: float, host: str = "127.0.0.1", colocated: bool = True) -> list[str]:
    """The SGLang command line of one engine process on GPUs, as SGLang's server arguments want it."""
    command = [
        ENGINE_PY, str(KEY_ENTRY), "USERRL_ENGINE_API_KEY", "sglang.launch_server",  # --api-key from that variable
        "--model-path", model,
        "--served-model-name", Path(model).name,  # the pool's: sglang-router lists it without the key
        "--host", host,
        "--port", str(port),
        "--tp-size", str(tp),
        "--dtype", "bfloat16",
        "--mem-fraction-static", str(mem),
        "--base-gpu-id", "0",
        "--skip-server-warmup",
    ]  # fmt: skip
    return [*command, "--enable-memory-saver"] if colocated else command


def spanning(command: list[str], nnodes: int, node_rank: int, address: str) -> list[str]:
    """`command` of one node's process of an engine spanning `nnodes` nodes."""
    at = command.index("--skip-server-warmup")
    return [
        *command[:at],
        "--nnodes",
        str(nnodes),
        "--node-rank",
        str(node_rank),
        "--dist-init-addr",
        address,
        *command[at:],
    ]


def tensor_groups(result: BringUp) -> list[tuple]:
    """(group, members, holders) of each tensor-handle sync group, as its source rank records it; every member
    recorded its part, and every handle is to a GPU its engine sees (`unseen_handles`)."""
    groups = []
    for role in result.sync:
        assert role.method == "tensor"
        if role.rank == role.members[0]:
            groups.append((role.group, role.members, role.holders))
    for group, members, _ in groups:
        assert sorted(r.rank for r in result.sync if r.group == group) == members
    assert unseen_handles(result) == []
    return groups


def unseen_handles(result: BringUp) -> list[str]:
    """Each engine TP rank whose tensor handle is to memory on a GPU its engine process does not see, as the
    launcher placed them: the holder rank's node and `CUDA_VISIBLE_DEVICES` against those of the engine's process
    on the TP rank's node (an engine spanning nodes runs one process per node, its TP ranks in node order). SGLang
    0.5.23 opens a handle only on a GPU it sees (sglang/srt/utils/patch_torch.py:89-97, "Invalid device_uuid")."""
    parts: dict[int, list] = {}
    for process in result.engines:
        parts.setdefault(process.engine, []).append(process)
    found = []
    for role in result.sync:
        if role.method != "tensor" or role.rank != role.members[0]:
            continue
        for engine, holders in enumerate(role.holders):
            per_part = len(holders) // len(parts[engine])
            for j, holder in enumerate(holders):
                part = parts[engine][j // per_part]
                rank = result.ranks[holder]
                gpus = part.launch.env["CUDA_VISIBLE_DEVICES"].split(",")
                if rank.ip != part.ip or rank.visible_devices not in gpus:
                    found.append(
                        f"{role.group}: engine {engine} TP rank {j} (node {part.ip}, GPUs {gpus}) maps rank {holder} "
                        f"(node {rank.ip}, GPU {rank.visible_devices})"
                    )
    return found


# ---- one node of 8 GPUs ----


@pytest.mark.parametrize("cluster", [1], indirect=True)
@pytest.mark.parametrize("config", ["configs/layout/qwen3-8b-h100x8.yaml", "examples/userrl_qwen3/config.yaml"])
def test_qwen3_8b_on_one_node(cluster: list[str], config: str) -> None:
    """TP2 x DP4 actor on GPUs 0-7; eight TP1 engines, engine e on GPU e; every rank hands the engine on its GPU
    its own copy of the weights."""
    head = cluster[DRIVER_NODE]
    result = up(config)
    assert ranks(result, cluster) == [
        (0, str(r), r, 8, "cuda:0", "nccl", head, (r % 2, 0, 0, r // 2, 0)) for r in range(8)
    ]
    assert engines(result, cluster) == [
        (e, 0, 0, {"CUDA_VISIBLE_DEVICES": str(e)}, f"http://127.0.0.1:{30000 + e}",
         sglang("/models/Qwen3-8B", 30000 + e, 1, 0.5))
        for e in range(8)
    ]  # fmt: skip
    assert tensor_groups(result) == [("userrl_sync_g0_pp0", list(range(8)), [[e] for e in range(8)])]
    assert result.router is None


@pytest.mark.parametrize("cluster", [1], indirect=True)
def test_qwen3_30b_a3b_h100_on_one_node_with_the_router(cluster: list[str]) -> None:
    """TP2 x EP4 over DP4: EP rank = DP rank; four TP2 engines, engine e on GPUs 2e and 2e + 1, their CUDA-graph
    pool released while the actor trains; sglang-router in front of them on the driver's node."""
    head = cluster[DRIVER_NODE]
    result = up("configs/layout/qwen3-30b-a3b-h100x8.yaml", "rollout.router=sglang")
    assert ranks(result, cluster) == [
        (0, str(r), r, 8, "cuda:0", "nccl", head, (r % 2, 0, 0, r // 2, r // 2)) for r in range(8)
    ]
    urls = [f"http://127.0.0.1:{30000 + e}" for e in range(4)]
    graphs = GRAPHS_ENV
    assert engines(result, cluster) == [
        (e, 0, 0, {"CUDA_VISIBLE_DEVICES": f"{2 * e},{2 * e + 1}"} | graphs, urls[e],
         [*sglang("/models/Qwen3-30B-A3B", 30000 + e, 2, 0.6), "--disable-prefill-cuda-graph"])
        for e in range(4)
    ]  # fmt: skip
    assert tensor_groups(result) == [("userrl_sync_g0_pp0", list(range(8)), [[0, 1], [2, 3], [4, 5], [6, 7]])]
    router = result.router
    assert router is not None and router.watch and router.env == {}
    # The run's key reaches the router and every engine in their environment only (never shown in `env`).
    keys = {e.launch.secrets["USERRL_ENGINE_API_KEY"] for e in result.engines} | {
        router.secrets["USERRL_ENGINE_API_KEY"]
    }
    assert len(keys) == 1 and len(keys.pop()) >= 32
    port = int(router.url.rsplit(":", 1)[1])
    assert router.url == f"http://127.0.0.1:{port}"
    prometheus = router.command[router.command.index("--prometheus-port") + 1]
    assert router.command == [
        PY, str(KEY_ENTRY), "USERRL_ENGINE_API_KEY", "sglang_router.launch_router",
        "--host", "127.0.0.1",
        "--port", str(port),
        "--worker-urls", *urls,
        "--policy", "round_robin",
        "--prometheus-port", prometheus,
        "--prometheus-host", "127.0.0.1",
        "--log-level", "warn",
    ]  # fmt: skip
    assert prometheus.isdigit() and prometheus != str(port)


@pytest.mark.parametrize("cluster", [1], indirect=True)
@pytest.mark.parametrize("config", ["configs/layout/qwen3-30b-a3b-h200x8.yaml", "examples/moe_tau/config.yaml"])
def test_qwen3_30b_a3b_h200_on_one_node(cluster: list[str], config: str) -> None:
    """EP8 over DP8 at TP1: rank r is DP and EP rank r; eight TP1 engines."""
    head = cluster[DRIVER_NODE]
    result = up(config)
    assert ranks(result, cluster) == [(0, str(r), r, 8, "cuda:0", "nccl", head, (0, 0, 0, r, r)) for r in range(8)]
    assert engines(result, cluster) == [
        (e, 0, 0, {"CUDA_VISIBLE_DEVICES": str(e)}, f"http://127.0.0.1:{30000 + e}",
         sglang("/models/Qwen3-30B-A3B", 30000 + e, 1, 0.7))
        for e in range(8)
    ]  # fmt: skip
    assert tensor_groups(result) == [("userrl_sync_g0_pp0", list(range(8)), [[e] for e in range(8)])]


@pytest.mark.parametrize("cluster", [1], indirect=True)
def test_tau2_qwen3_8b_with_its_simulator_on_the_policy_engines_gpus(cluster: list[str]) -> None:
    """examples/tau2/config.yaml: the 8B layout's actor (TP2 x DP4) and eight TP1 engines, told 0.8 (the policy's
    0.5 and the simulator's 0.3); simulator engine e on policy engine e's GPU, colocated (memory saver), schema-bound
    (no free JSON whitespace), behind a router of its own; both sides release their CUDA-graph pools."""
    result = up("examples/tau2/config.yaml")
    head = cluster[DRIVER_NODE]
    assert ranks(result, cluster) == [
        (0, str(r), r, 8, "cuda:0", "nccl", head, (r % 2, 0, 0, r // 2, 0)) for r in range(8)
    ]
    assert engines(result, cluster) == [
        (e, 0, 0, {"CUDA_VISIBLE_DEVICES": str(e)} | GRAPHS_ENV, f"http://127.0.0.1:{30000 + e}",
         [*sglang("/models/Qwen3-8B", 30000 + e, 1, 0.8), "--disable-prefill-cuda-graph"])
        for e in range(8)
    ]  # fmt: skip

    def simulator(e: int) -> list[str]:
        command = sglang("/models/Qwen3-8B", 31000 + e, 1, 0.3, colocated=False)
        command[2] = "USERRL_USER_SIM_ENGINE_KEY"
        return [*command, "--context-length", "32768", "--enable-memory-saver", "--disable-prefill-cuda-graph",
                *TIGHT_JSON]  # fmt: skip

    sims = [(e.engine, cluster.index(e.ip), e.launch.env, e.launch.url, command_of(e)) for e in result.simulator]
    assert sims == [
        (e, 0, {"CUDA_VISIBLE_DEVICES": str(e)} | GRAPHS_ENV, f"http://127.0.0.1:{31000 + e}", simulator(e))
        for e in range(8)
    ]
    assert tensor_groups(result) == [("userrl_sync_g0_pp0", list(range(8)), [[e] for e in range(8)])]
    router = result.simulator_router
    assert result.router is None and router is not None
    at = router.command.index("--worker-urls")
    assert router.command[at + 1 : at + 9] == [f"http://127.0.0.1:{31000 + e}" for e in range(8)]


@pytest.mark.parametrize("cluster", [1], indirect=True)
def test_handles_to_gpus_an_engine_does_not_see_are_found(cluster: list[str]) -> None:
    """Issue 55, item 3: eight TP1 engines colocated with four actor ranks (the config check refuses it; brought up
    unchecked here): engines 4-7 see GPUs 4-7, where no actor rank is, and are handed rank 0's copy on GPU 0."""
    overrides = ["megatron.devices_per_node=4", "megatron.tensor_model_parallel_size=2"]
    with pytest.raises(ConfigError) as refused:
        up("configs/layout/qwen3-8b-h100x8.yaml", *overrides)
    assert [p for p in refused.value.problems if p.startswith("sync.method = auto")] != []
    cfg = load_config([str(REPO / "configs/layout/qwen3-8b-h100x8.yaml")], overrides, check=False)
    with ThreadPoolExecutor(1) as pool:
        result = pool.submit(bring_up, cfg).result(timeout=HANG_S)
    [(_, members, holders)] = [(r.group, r.members, r.holders) for r in result.sync if r.rank == r.members[0]]
    assert members == [0, 1, 2, 3] and holders == [[0], [1], [2], [3], [0], [0], [0], [0]]
    assert [line.split(" (node")[0] for line in unseen_handles(result)] == [
        f"userrl_sync_g0_pp0: engine {e} TP rank 0" for e in range(4, 8)
    ]


@pytest.mark.parametrize("cluster", [1], indirect=True)
def test_a_layout_larger_than_the_cluster_fails_in_one_line(cluster: list[str]) -> None:
    with pytest.raises(UserError) as failure:
        up("configs/layout/qwen3-32b-h100x16.yaml")
    assert str(failure.value) == "the run needs 16 GPUs (16 bundles of CPU 1, GPU 1) and the Ray cluster has 8"


# ---- two nodes of 8 GPUs ----


@pytest.mark.parametrize("cluster", [2], indirect=True)
def test_qwen3_32b_on_two_nodes(cluster: list[str]) -> None:
    """TP8 x DP2: a TP group per node, rank 0 on the driver's node is the master; four TP4 engines, two per
    node, each seeing its four GPUs and listening on every address (the driver is on node 0)."""
    head = cluster[DRIVER_NODE]
    result = up("configs/layout/qwen3-32b-h100x16.yaml")
    assert ranks(result, cluster) == [
        (r // 8, str(r % 8), r % 8, 16, "cuda:0", "nccl", head, (r % 8, 0, 0, r // 8, 0)) for r in range(16)
    ]
    gpus = ["0,1,2,3", "4,5,6,7"]
    assert engines(result, cluster) == [
        (e, e // 2, 0, {"CUDA_VISIBLE_DEVICES": gpus[e % 2]}, f"http://{cluster[e // 2]}:{30000 + e}",
         sglang("/models/Qwen3-32B", 30000 + e, 4, 0.6, host="0.0.0.0"))
        for e in range(4)
    ]  # fmt: skip
    # engines 2 and 3 map the copies of ranks 8-15, on their own node
    holders = [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    assert tensor_groups(result) == [("userrl_sync_g0_pp0", list(range(16)), holders)]


@pytest.mark.parametrize("cluster", [2], indirect=True)
def test_qwen3_32b_with_the_user_simulator_on_the_policy_engines_gpus(cluster: list[str]) -> None:
    """`user_sim.engines.placement: policy_engines`: the policy exactly as in the 32B layout on its two nodes (TP8 x
    DP2, four TP4 engines, SGLang told 0.8: its 0.5 and the simulator's 0.3), and simulator engine e on policy
    engine e's node and GPUs, with the memory saver (colocated: it releases its KV cache while the actor trains), its
    own fraction, ports, key and router. Both sides release their CUDA-graph pools while the actor trains
    (rollout.sglang.release_cuda_graph). No third node: the cluster has exactly the policy's 16 GPUs."""
    head = cluster[DRIVER_NODE]
    result = up("configs/layout/qwen3-32b-h100x16-usersim-shared.yaml")
    assert result.nodes == cluster
    assert ranks(result, cluster) == [
        (r // 8, str(r % 8), r % 8, 16, "cuda:0", "nccl", head, (r % 8, 0, 0, r // 8, 0)) for r in range(16)
    ]
    gpus = ["0,1,2,3", "4,5,6,7"]
    graphs = {"SGLANG_MEMORY_SAVER_CUDA_GRAPH": "1"}  # rollout.sglang.release_cuda_graph: the pool leaves for training
    assert engines(result, cluster) == [
        (e, e // 2, 0, {"CUDA_VISIBLE_DEVICES": gpus[e % 2]} | graphs, f"http://{cluster[e // 2]}:{30000 + e}",
         [*sglang("/models/Qwen3-32B", 30000 + e, 4, 0.8, host="0.0.0.0"), "--disable-prefill-cuda-graph"])
        for e in range(4)
    ]  # fmt: skip

    def simulator(e: int) -> list[str]:
        command = sglang("/models/Qwen3-32B", 31000 + e, 4, 0.3, host="0.0.0.0", colocated=False)
        command[2] = "USERRL_USER_SIM_ENGINE_KEY"
        return [
            *command,
            "--context-length",
            "32768",
            "--enable-memory-saver",
            "--disable-prefill-cuda-graph",
            *TIGHT_JSON,
        ]

    holders = [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    assert tensor_groups(result) == [("userrl_sync_g0_pp0", list(range(16)), holders)]
    assert all(e.launch.watch for e in result.simulator)
    sims = [(e.engine, node, e.node_rank, e.launch.env) for e in result.simulator for node in [cluster.index(e.ip)]]
    policy = [(e.engine, node, e.node_rank, e.launch.env) for e in result.engines for node in [cluster.index(e.ip)]]
    assert sims == policy  # each simulator engine on exactly its policy engine's node and GPUs
    assert [(e.launch.url, command_of(e)) for e in result.simulator] == [
        (f"http://{cluster[e // 2]}:{31000 + e}", simulator(e)) for e in range(4)
    ]
    keys = {e.launch.secrets["USERRL_USER_SIM_ENGINE_KEY"] for e in result.simulator}
    assert len(keys) == 1 and keys != {e.launch.secrets["USERRL_ENGINE_API_KEY"] for e in result.engines}
    router = result.simulator_router
    assert result.router is None and router is not None
    at = router.command.index("--worker-urls")
    assert router.command[at + 1 : at + 5] == [f"http://{cluster[e // 2]}:{31000 + e}" for e in range(4)]
    text = format_placement(result).splitlines()
    assert [line.split("  ")[:3] for line in text if "user sim engine" in line] == [
        [
            f"node {e // 2}",
            f"user sim engine {e}",
            f"CUDA_VISIBLE_DEVICES={gpus[e % 2]} SGLANG_MEMORY_SAVER_CUDA_GRAPH=1",
        ]
        for e in range(4)
    ]


@pytest.mark.parametrize("cluster", [2], indirect=True)
def test_a_disaggregated_policy_shares_only_its_engines_gpus(cluster: list[str]) -> None:
    """Disaggregated (the 8B layout's actor on node 0, eight TP1 engines on node 1): a simulator engine per policy
    engine, on that engine's GPU of node 1, never on an actor rank's; no memory saver (nothing steps aside)."""
    result = up(
        "configs/layout/qwen3-8b-h100x8.yaml",
        "rollout.colocate=false",
        "rollout.sglang.host=0.0.0.0",
        "megatron.offload=false",
        "user_sim.engines.model=/models/Qwen3-8B",
        "user_sim.engines.num_engines=8",
        "user_sim.engines.backend=sglang",
        "user_sim.engines.placement=policy_engines",
        "rollout.sglang.mem_fraction_static=0.5",
        "user_sim.engines.mem_fraction_static=0.3",
    )
    actor = {(cluster.index(r.ip), r.visible_devices) for r in result.ranks}
    policy = [(cluster.index(e.ip), e.launch.env["CUDA_VISIBLE_DEVICES"]) for e in result.engines]
    sims = [(cluster.index(e.ip), e.launch.env["CUDA_VISIBLE_DEVICES"]) for e in result.simulator]
    assert actor == {(0, str(g)) for g in range(8)} and policy == sims == [(1, str(g)) for g in range(8)]
    assert all("--enable-memory-saver" not in e.launch.command for e in result.simulator)
    assert [e.launch.command[e.launch.command.index("--mem-fraction-static") + 1] for e in result.engines] == [
        "0.8"
    ] * 8


@pytest.mark.parametrize("cluster", [2], indirect=True)
def test_the_user_simulators_engines_on_gpus_of_their_own(cluster: list[str]) -> None:
    """The 8B layout fills one node; a TP2 simulator engine (`user_sim.engines`) goes to the other in a placement group
    of its own: its own GPUs, its own key variable and ports, never the memory saver (it shares no GPU). On
    another node than the driver's it must listen on an address the driver reaches, as a policy engine must."""
    result = up(
        "configs/layout/qwen3-8b-h100x8.yaml",
        "user_sim.engines.model=/models/Qwen3-32B",
        "user_sim.engines.engine_tp=2",
        "user_sim.engines.backend=sglang",
        "rollout.sglang.host=0.0.0.0",  # reachable from the driver's node (a simulator engine on node 0 needs not)
    )
    assert [e.engine for e in result.engines] == list(range(8))  # the policy's engines as without a simulator
    command = sglang("/models/Qwen3-32B", 31000, 2, 0.5, host="0.0.0.0", colocated=False)
    command[2] = "USERRL_USER_SIM_ENGINE_KEY"
    command += TIGHT_JSON
    assert [(e.engine, e.launch.env, command_of(e)) for e in result.simulator] == [
        (0, {"CUDA_VISIBLE_DEVICES": "0,1"}, command)
    ]
    assert {e.ip for e in result.engines} == {r.ip for r in result.ranks} != {result.simulator[0].ip}  # other node
    assert result.simulator[0].ip in cluster and result.nodes == cluster  # the driver's node first, then by IP
    assert f"node {cluster.index(result.simulator[0].ip)}  user sim engine 0  " in format_placement(result)


@pytest.mark.parametrize("cluster", [2], indirect=True)
def test_a_run_whose_simulator_does_not_fit_beside_the_policy_fails_in_one_line(cluster: list[str]) -> None:
    """The policy alone fits two nodes, the simulator's engines alone too; both do not, and the simulator's group,
    reserved second, would wait for GPUs that never come."""
    with pytest.raises(UserError) as failure:
        up("configs/layout/qwen3-32b-h100x24-usersim.yaml")
    assert str(failure.value) == (
        "the run needs 24 GPUs (16 for the actor and the policy's engines, 8 for the user simulator's engines) and "
        "the Ray cluster has 16"
    )


@pytest.mark.parametrize("cluster", [2], indirect=True)
def test_an_engine_spanning_two_nodes(cluster: list[str]) -> None:
    """One TP16 engine over both nodes: node rank 0 on the driver's node serves HTTP and is the rendezvous of
    node rank 1; each process sees the eight GPUs of its node."""
    result = up("configs/layout/qwen3-32b-h100x16.yaml", "rollout.num_engines=1", "rollout.engine_tp=16")
    address = result.engines[0].launch.command[result.engines[0].launch.command.index("--dist-init-addr") + 1]
    host, port = address.rsplit(":", 1)
    assert host == cluster[0] and port.isdigit()
    command = sglang("/models/Qwen3-32B", 30000, 16, 0.6, host="0.0.0.0")
    every_gpu = {"CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}
    assert engines(result, cluster) == [
        (0, 0, 0, every_gpu, f"http://{cluster[0]}:30000", spanning(command, 2, 0, address)),
        (0, 1, 1, every_gpu, "", spanning(command, 2, 1, address)),
    ]
    assert tensor_groups(result) == [("userrl_sync_g0_pp0", list(range(16)), [list(range(16))])]


@pytest.mark.parametrize("cluster", [2], indirect=True)
def test_disaggregated_engine_on_the_second_node(cluster: list[str]) -> None:
    """TP8 actor on node 0, one TP8 engine on node 1 (no memory saver: it shares no GPU); the weights go over a
    broadcast group of the source rank and the engine's eight ranks."""
    head = cluster[DRIVER_NODE]
    result = up(
        "configs/layout/qwen3-32b-h100x16.yaml",
        "megatron.nnodes=1",
        "rollout.colocate=false",
        "rollout.num_engines=1",
        "rollout.engine_tp=8",
    )
    assert ranks(result, cluster) == [(0, str(r), r, 8, "cuda:0", "nccl", head, (r, 0, 0, 0, 0)) for r in range(8)]
    every_gpu = {"CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}
    command = sglang("/models/Qwen3-32B", 30000, 8, 0.6, host="0.0.0.0", colocated=False)
    assert engines(result, cluster) == [(0, 1, 0, every_gpu, f"http://{cluster[1]}:30000", command)]
    assert [(s.group, s.method, s.rank, s.world_size, s.engine_ranks) for s in result.sync] == [
        ("userrl_sync_g0_pp0", "distributed", 0, 9, [1])
    ]


@pytest.mark.parametrize("cluster", [2], indirect=True)
def test_an_engine_the_driver_cannot_reach_fails_in_one_line(cluster: list[str]) -> None:
    with pytest.raises(UserError) as failure:
        up("configs/layout/qwen3-32b-h100x16.yaml", "rollout.sglang.host=127.0.0.1")
    assert str(failure.value) == (
        f"engine 2 runs on node 1 ({cluster[1]}), not the driver's, and rollout.sglang.host = 127.0.0.1 is reachable "
        "from its own node only: set rollout.sglang.host = 0.0.0.0"
    )


# ---- three nodes of 8 GPUs ----


@pytest.mark.parametrize("cluster", [3], indirect=True)
@pytest.mark.parametrize(
    ("config", "releases_graphs"),
    [("configs/layout/qwen3-32b-h100x24-usersim.yaml", False), ("examples/tau2/config-32b.yaml", True)],
)
def test_qwen3_32b_with_the_user_simulator_on_a_third_node(
    cluster: list[str], config: str, releases_graphs: bool
) -> None:
    """The policy of the 32B layout exactly as on two nodes of its own (TP8 x DP2, a TP group per node, four TP4
    engines); the simulator's four TP2 engines on the third node, GPUs 0-1, 2-3, 4-5, 6-7, with the simulator's
    memory fraction and context length, behind a router of their own. The two placement groups are reserved apart,
    so Ray picks which node the simulator gets (the driver's or another); whichever it is holds no actor rank and
    no policy engine, and no simulator GPU is anywhere else. The tau2 recipe's policy engines also release their
    CUDA-graph pool while the actor trains."""
    result = up(config)
    assert result.nodes == cluster  # the driver's node first, then by IP, whichever holds what
    node = {ip: i for i, ip in enumerate(cluster)}
    policy = sorted({node[r.ip] for r in result.ranks} | {node[e.ip] for e in result.engines})
    [sim_node] = {node[e.ip] for e in result.simulator}
    assert len(policy) == 2 and sorted([*policy, sim_node]) == [0, 1, 2]  # a node to itself
    master = cluster[policy[0]]  # rank 0 on the first of the policy's nodes: the driver's, or the lower IP
    assert ranks(result, cluster) == [
        (policy[r // 8], str(r % 8), r % 8, 16, "cuda:0", "nccl", master, (r % 8, 0, 0, r // 8, 0)) for r in range(16)
    ]
    gpus = ["0,1,2,3", "4,5,6,7"]
    graphs = GRAPHS_ENV if releases_graphs else {}
    released = ["--disable-prefill-cuda-graph"] if releases_graphs else []
    assert engines(result, cluster) == [
        (e, policy[e // 2], 0, {"CUDA_VISIBLE_DEVICES": gpus[e % 2]} | graphs,
         f"http://{cluster[policy[e // 2]]}:{30000 + e}",
         [*sglang("/models/Qwen3-32B", 30000 + e, 4, 0.6, host="0.0.0.0"), *released])
        for e in range(4)
    ]  # fmt: skip
    holders = [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    assert tensor_groups(result) == [("userrl_sync_g0_pp0", list(range(16)), holders)]

    def simulator(e: int) -> list[str]:  # frozen, on GPUs of its own: no memory saver
        command = sglang("/models/Qwen3-32B", 31000 + e, 2, 0.85, host="0.0.0.0", colocated=False)
        command[2] = "USERRL_USER_SIM_ENGINE_KEY"
        return [*command, "--context-length", "32768", *TIGHT_JSON]

    assert all(e.launch.watch for e in result.simulator)
    assert [
        (e.engine, node[e.ip], e.node_rank, e.launch.env, e.launch.url, command_of(e)) for e in result.simulator
    ] == [
        (e, sim_node, 0, {"CUDA_VISIBLE_DEVICES": f"{2 * e},{2 * e + 1}"}, f"http://{cluster[sim_node]}:{31000 + e}",
         simulator(e))
        for e in range(4)
    ]  # fmt: skip
    keys = {e.launch.secrets["USERRL_USER_SIM_ENGINE_KEY"] for e in result.simulator}
    assert len(keys) == 1 and keys != {e.launch.secrets["USERRL_ENGINE_API_KEY"] for e in result.engines}
    router = result.simulator_router
    assert result.router is None and router is not None and router.command[2] == "USERRL_USER_SIM_ENGINE_KEY"
    at = router.command.index("--worker-urls")
    assert router.command[at + 1 : at + 5] == [f"http://{cluster[sim_node]}:{31000 + e}" for e in range(4)]
    text = format_placement(result).splitlines()
    assert [line.split("  ")[:2] for line in text if "user sim" in line] == [
        *([f"node {sim_node}", f"user sim engine {e}"] for e in range(4)),
        ["node 0", "user sim router"],
    ]
    assert text[-1] == f"nodes  0 {cluster[0]} (the driver's), 1 {cluster[1]}, 2 {cluster[2]}"


# ---- four nodes of 8 GPUs ----


@pytest.mark.parametrize("cluster", [4], indirect=True)
@pytest.mark.parametrize("config", ["configs/layout/qwen3-32b-h200x32.yaml", "examples/mua_tau/config.yaml"])
def test_qwen3_32b_on_four_nodes(cluster: list[str], config: str) -> None:
    """TP8 x DP4, a TP group per node; sixteen TP2 engines, four per node."""
    head = cluster[DRIVER_NODE]
    result = up(config)
    assert ranks(result, cluster) == [
        (r // 8, str(r % 8), r % 8, 32, "cuda:0", "nccl", head, (r % 8, 0, 0, r // 8, 0)) for r in range(32)
    ]
    assert engines(result, cluster) == [
        (e, e // 4, 0, {"CUDA_VISIBLE_DEVICES": f"{2 * (e % 4)},{2 * (e % 4) + 1}"},
         f"http://{cluster[e // 4]}:{30000 + e}", sglang("/models/Qwen3-32B", 30000 + e, 2, 0.7, host="0.0.0.0"))
        for e in range(16)
    ]  # fmt: skip
    assert tensor_groups(result) == [("userrl_sync_g0_pp0", list(range(32)), [[2 * e, 2 * e + 1] for e in range(16)])]


# ---- what users see ----


def test_userrl_plan_placement_prints_a_line_per_process() -> None:
    """`userrl plan --placement` brings the layout up on a cluster of its own shape, the same way."""
    command = [sys.executable, "-m", "userrl_megatron", "plan", "--config", "configs/layout/qwen3-8b-h100x8.yaml"]
    out = subprocess.run([*command, "--placement"], capture_output=True, text=True, cwd=REPO, timeout=HANG_S)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert len(lines) == 8 + 8 + 1 + 1  # actor ranks, engines, the sync group, the node
    assert lines[1].startswith("node 0  rank 1/8  local rank 1  CUDA_VISIBLE_DEVICES=1  cuda:0 nccl  ")
    assert "  tp 1/2 pp 0/1 cp 0/1 dp 0/4 ep 0/1  master " in lines[1]
    assert re.sub(r" --nccl-port \d+", "", lines[9]) == (
        f"node 0  engine 1  CUDA_VISIBLE_DEVICES=1  {' '.join(sglang('/models/Qwen3-8B', 30001, 1, 0.5))}"
    )
    assert lines[16] == (
        "sync userrl_sync_g0_pp0  tensor handles from ranks [0, 1, 2, 3, 4, 5, 6, 7]; engine TP ranks map "
        "[[0], [1], [2], [3], [4], [5], [6], [7]]"
    )
    assert lines[17].startswith("nodes  0 ") and lines[17].endswith(" (the driver's)")
