"""A memory ledger behind the trainer's own choreography: stand-ins for the actor group, the engine pool and the
episode runner that book bytes per device instead of computing.

`trainer.components` (start-up order), `trainer.handoff` (enter_training / enter_rollout),
`trainer.weight_sync` (syncs, repairs) and `trainer.driver.Trainer.fit` run unchanged on these parts, so the plan
follows the order the trainer really uses: change that order and the plan changes with it. Each call books what
it allocates or frees, then records the phase it belongs to with what every device holds at that moment (the
phase's peak over the run). The actor ranks' pinned host memory is booked as the calls first allocate it
(offload, saves), and kept: torch keeps it. They meet the protocols of `trainer/seams.py`, as the real parts do.
"""

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from userrl_megatron.config.resolve import keeps_weights
from userrl_megatron.config.schema import CheckpointConfig
from userrl_megatron.megatron.offload import GRADS, NEEDS, STATE, WEIGHTS
from userrl_megatron.plan.memory import ActorMemory, EngineMemory, HostMemory, sglang_kv_pool
from userrl_megatron.rollout.admission import GroupGate
from userrl_megatron.types import Episode, EpisodeGroup, SamplingParams, Task, TrainBatch, Turn

ACTOR_STATE = ("actor weights", "actor grads", "actor optimizer")
LABELS = dict(zip((WEIGHTS, GRADS, STATE), ACTOR_STATE, strict=True))  # offload's kinds -> the ledger's labels
ENGINE_TAGS = {"weights": "engine weights", "kv_cache": "engine KV cache", "cuda_graph": "engine runtime"}
# The user simulator's engines on the policy engines' GPUs (user_sim.engines.placement: policy_engines).
SIMULATOR_TAGS = {"weights": "user sim weights", "kv_cache": "user sim KV cache", "cuda_graph": "user sim runtime"}


@dataclass
class Ledger:
    """What every device holds now, and each phase's peak: {phase: [(total, breakdown) per device]}."""

    device_bytes: int
    held: list[dict[str, int]]
    peaks: dict[str, list[tuple[int, dict[str, int]]]] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    phase: str = ""  # the phase recorded last: where the run is now
    # Engines (by URL) whose weights were released without a host copy and not pushed since: they hold garbage.
    empty_weights: set[str] = field(default_factory=set)
    groups: dict[str, list[str]] = field(default_factory=dict)  # weight-sync group -> the URLs of its engines

    @classmethod
    def of(cls, devices: int, device_bytes: int) -> "Ledger":
        return cls(device_bytes, [{} for _ in range(devices)])

    def book(self, device: int, label: str, nbytes: int) -> None:
        holding = self.held[device]
        holding[label] = holding.get(label, 0) + nbytes
        if holding[label] == 0:
            del holding[label]

    def free(self, device: int, label: str) -> int:
        return self.held[device].pop(label, 0)

    def record(self, phase: str, temporaries: dict[int, dict[str, int]] | None = None) -> None:
        """The devices' holdings (plus this call's temporaries) as a candidate for `phase`'s peak."""
        self.phase = phase
        peaks = self.peaks.setdefault(phase, [(0, {}) for _ in self.held])
        for device, holding in enumerate(self.held):
            now = dict(holding)
            for label, nbytes in (temporaries or {}).get(device, {}).items():
                now[label] = now.get(label, 0) + nbytes
            total = sum(now.values())
            if total > peaks[device][0]:
                peaks[device] = (total, now)

    def complain(self, problem: str) -> None:
        if problem not in self.problems:
            self.problems.append(problem)


@dataclass(frozen=True)
class Restart:
    """An engine the trainer restarts: after which phase, the memory free on its GPUs before it loads its weights
    (SGLang sizes its KV pool from it, for the engine's life), and its KV pool in tokens (0: none; SGLang refuses
    to start, and the pool gives the engine up after `rollout.engine_max_restarts`)."""

    after: str
    free: int
    kv_tokens: int


class LedgerActors:
    """The actor group (`actors.workers.ActorGroup`): rank r on device `devices[r]`, every rank alike.

    `sync_bytes`: the two live buckets of a weight sync; `kept_buckets`: they stay on the device between syncs
    (the broadcast's two flat buffers are reused, so they are never freed); `export_bytes`: the HF export's
    working set beside them (`memory.export_working_set`). `host`: the pinned host memory of a
    rank, booked in `host_held` as each part is first allocated (the KL reference at start-up)."""

    def __init__(
        self,
        ledger: Ledger,
        memory: ActorMemory,
        devices: list[int],
        bucket_bytes: int,
        sync_bytes: int | None = None,
        kept_buckets: bool = False,
        export_bytes: int = 0,
        host: HostMemory | None = None,
    ) -> None:
        self.ledger, self.memory, self.devices, self.bucket_bytes = ledger, memory, devices, bucket_bytes
        self.sync_bytes = 2 * bucket_bytes if sync_bytes is None else sync_bytes
        self.kept_buckets, self.export_bytes = kept_buckets, export_bytes
        self.host = host or HostMemory(0, 0, 0, 0, 0)
        self.host_held: dict[str, int] = {"KL reference": self.host.reference} if self.host.reference else {}
        self.held_on_host: set[str] = set()  # labels in host memory now
        self.parked: set[str] = set()  # labels ever copied to the host by an offload
        for device in devices:  # built with the HF weights loaded: everything on the device
            for label, nbytes in self._state().items():
                ledger.book(device, label, nbytes)
        ledger.record("start-up")

    def _state(self) -> dict[str, int]:
        m = self.memory
        return dict(zip(ACTOR_STATE, (m.weights, m.grads, m.optimizer), strict=True))

    def offload(self, weights: bool = True) -> None:
        labels = ACTOR_STATE if weights else ACTOR_STATE[1:]
        for label in labels:
            for device in self.devices:
                self.ledger.free(device, label)
        self.held_on_host.update(labels)
        self.parked.update(labels)  # the host regions stay allocated after onload, for the next offload
        held = self.host.offload("actor weights" in self.parked, "actor optimizer" in self.parked)
        self.host_held["offload"] = held

    def onload(self, weights_only: bool = False) -> None:
        state = self._state()
        back = [label for label in sorted(self.held_on_host) if label == "actor weights" or not weights_only]
        for label in back:
            for device in self.devices:
                self.ledger.book(device, label, state[label])
        self.held_on_host.difference_update(back)

    def offloaded(self) -> list[str]:
        kinds = {label: kind for kind, label in LABELS.items()}
        return sorted(kinds[label] for label in self.held_on_host)

    def _need(self, what: str) -> None:
        labels = {LABELS[kind] for kind in NEEDS[what]}
        missing = [label for label in ACTOR_STATE if label in labels and label in self.held_on_host]
        if missing:
            self.ledger.complain(f"{what} runs while the {', '.join(missing)} are offloaded (it would crash)")

    def compute_logprobs(self, batch: TrainBatch, trained_only: bool = False) -> list[list[float]]:
        # Planned at full size: the logits of trained positions only are never larger.
        self._need("a log-prob pass")
        m = self.memory
        self._temporary("log-probs", {"actor activations": m.forward_activations, "actor logits": m.forward_logits})
        return [[0.0] * (sum(mask) if trained_only else len(mask)) for mask in batch.loss_mask]

    def compute_ref_logprobs(self, batch: TrainBatch) -> list[list[float]]:
        return self.compute_logprobs(batch, trained_only=True)

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        self._need("a training step")
        m = self.memory
        self._temporary("training", {"actor activations": m.train_activations, "actor logits": m.train_logits})
        return {"actor/loss": 0.0}

    def save(self, path: str, extra_state: dict[str, Any], ckpt: CheckpointConfig, background: bool) -> None:
        self._need("a checkpoint save")
        staging = self.host.staging if ckpt.save_optimizer else self.host.staging_model_only
        self.host_held["checkpoint staging"] = max(self.host_held.get("checkpoint staging", 0), staging)
        self.ledger.record("checkpoint")

    def finish_save(self, wait: bool) -> bool:
        return True  # a background save writes from host staging buffers: no device memory

    def load(self, path: str, with_optimizer: bool = True) -> dict[str, Any]:
        return {}

    def load_weights(self, path: str) -> None:
        return None

    def export_hf(self, out_dir: str) -> str | None:
        self._need("an HF export")
        self._temporary("HF export", {"export buffer": self.bucket_bytes})
        return out_dir

    def _temporary(self, phase: str, temporaries: dict[str, int]) -> None:
        self.ledger.record(phase, {device: temporaries for device in self.devices})

    def push_weights(self, group_names: list[str], version: int) -> dict[str, float]:
        self._need("a weight export")
        for name in group_names:
            self.ledger.empty_weights.difference_update(self.ledger.groups.get(name, []))
        export = {"export working set": self.export_bytes} if self.export_bytes else {}
        if not self.kept_buckets:
            self._temporary("weight sync", {"sync buckets (2)": self.sync_bytes, **export})
            return {}
        for device in self.devices:
            if "sync buckets (2)" not in self.ledger.held[device]:
                self.ledger.book(device, "sync buckets (2)", self.sync_bytes)
        self._temporary("weight sync", export)
        return {}

    def connect_engines(self, engines: list[dict[str, Any]], group_prefix: str, method: str) -> list[str]:
        self.ledger.groups[group_prefix] = [e["url"] for e in engines]
        return [group_prefix]

    def disconnect_engines(self, group_names: list[str]) -> None:
        return None

    def weight_checksums(self, rows: int) -> dict[str, float]:
        return {}


class LedgerClient:
    """One engine's HTTP client: memory release and resume, as SGLang's memory saver does them (released weights
    without a host copy come back empty: the engine is marked until a push reaches it)."""

    def __init__(self, pool: "LedgerPool", index: int) -> None:
        self.pool, self.index = pool, index
        self.base_url = f"{pool.name}-{index}"
        self.released: dict[str, int] = {}  # tag -> bytes per device

    async def release_memory(self, tags: list[str]) -> None:
        for tag in tags:
            if tag == "cuda_graph" and not self.pool.frees_graphs:  # SGLang pauses an empty region: nothing freed
                self.released[tag] = 0
                continue
            for device in self.pool.devices_of(self.index):
                self.released[tag] = self.pool.ledger.free(device, self.pool.labels[tag])
        if "weights" in tags and not keeps_weights(self.pool.rollout):
            self.pool.ledger.empty_weights.add(self.base_url)

    async def resume_memory(self, tags: list[str]) -> None:
        for tag in tags:
            nbytes = self.released.pop(tag, 0)
            for device in self.pool.devices_of(self.index):
                self.pool.ledger.book(device, self.pool.labels[tag], nbytes)

    async def get_weights_by_name(self, name: str, truncate_size: int = 0) -> list[float]:
        return []

    async def destroy_weights_update_group(self, name: str) -> None:
        return None


class LedgerPool:
    """The engine pool (`fleet.pool.RolloutPool`): engine e on devices `devices[e]`. `labels`: the ledger's label of
    each memory tag (two pools on the same GPUs book apart); `name`: an engine's name in a problem."""

    def __init__(
        self,
        ledger: Ledger,
        memory: EngineMemory,
        rollout: Any,
        devices: list[list[int]],
        labels: dict[str, str] | None = None,
        name: str = "engine",
        restart_rollout: Any = None,
    ) -> None:
        from userrl_megatron.fleet.sglang import releases_cuda_graphs

        self.ledger, self.memory, self.rollout, self.engine_devices = ledger, memory, rollout, devices
        self.labels, self.name = labels or ENGINE_TAGS, name
        self.restart_rollout = restart_rollout or rollout  # the settings a restarted engine is launched with
        # SGLang frees its CUDA-graph pool on release only when the launcher asked for it; the embedded engine has
        # none, and its release of weights empties torch's cache of what its decode steps held.
        self.frees_graphs = rollout.backend != "sglang" or releases_cuda_graphs(rollout.sglang, rollout.colocate)
        self.smallest_restart: Restart | None = None  # the smallest KV pool an engine restarted by the trainer gets
        self.clients = [LedgerClient(self, e) for e in range(len(devices))]
        self.urls = [c.base_url for c in self.clients]
        self.kv_tokens: list[int] = []
        self.exhausted, self.restarts_total, self.log_dir = False, 0, None
        self.concurrency = 1
        self.api_key = ""  # the simulated engines require none
        self.model_path = ""  # they load no checkpoint

    def devices_of(self, engine: int) -> list[int]:
        return self.engine_devices[engine]

    async def start(self) -> None:
        """Each engine loads its weights, then sizes its KV pool from what was free on its GPUs when it started."""
        m = self.memory
        for engine, devices in enumerate(self.engine_devices):
            at_start = min(self.ledger.device_bytes - sum(self.ledger.held[d].values()) for d in devices)
            for device in devices:
                self.ledger.book(device, self.labels["weights"], m.weights)
            kv = self._kv_bytes(at_start - m.weights, at_start, self.rollout)
            if kv <= 0:
                self.ledger.complain(
                    f"{self.name} {engine} starts with {(at_start - m.weights) / 2**30:.1f} GiB free after its "
                    f"weights on GPU {devices[0]}: no room for a KV cache"
                )
                kv = 0
            self.kv_tokens.append(kv // m.kv_token)
            for device in devices:
                self.ledger.book(device, self.labels["kv_cache"], kv)
                self.ledger.book(device, self.labels["cuda_graph"], m.runtime)
        self.ledger.record("start-up")

    def _kv_bytes(self, free_after_weights: int, free_at_start: int, rollout: Any) -> int:
        if rollout.backend == "sglang":
            return sglang_kv_pool(free_after_weights, free_at_start, rollout.sglang.mem_fraction_static)
        if rollout.sglang.max_total_tokens:
            return rollout.sglang.max_total_tokens * self.memory.kv_token
        embedded = rollout.embedded  # a running request's KV grows to its context; finished ones are cached
        context = rollout.max_prompt_tokens + rollout.max_response_tokens
        if embedded.context_length:  # no request grows beyond what the engine serves
            context = min(context, embedded.context_length)
        return (embedded.max_running_requests * context + embedded.prefix_cache_tokens) * self.memory.kv_token

    async def pause(self, mode: str = "abort") -> None:
        return None

    async def resume(self) -> None:
        return None

    async def flush_cache(self) -> None:
        return None

    async def repair(self, timeout_s: float) -> None:
        """Where the trainer restarts dead engines: the KV pool an engine restarted here would size, from what its
        GPUs hold now less its own memory (gone with its process); the smallest over the run is kept (the latest
        of equals)."""
        own = set(self.labels.values())
        for devices in self.engine_devices:
            held = [sum(n for label, n in self.ledger.held[d].items() if label not in own) for d in devices]
            at_start = self.ledger.device_bytes - max(held)
            kv = max(self._kv_bytes(at_start - self.memory.weights, at_start, self.restart_rollout), 0)
            restart = Restart(self.ledger.phase, at_start, kv // self.memory.kv_token)
            smallest = self.smallest_restart
            if smallest is None or (restart.kv_tokens, restart.free) <= (smallest.kv_tokens, smallest.free):
                self.smallest_restart = restart

    async def restart(self, urls: list[str], timeout_s: float) -> list[LedgerClient]:
        return self.clients

    def add_restart_hook(self, hook: Callable[[int, Any], Awaitable[None]]) -> None:
        """A plan's engines never restart: nothing would call it."""

    def session(self, episode_id: str = "") -> None:
        return None

    async def kill_engine_server(self, index: int) -> int:
        """A drill's kill (`trainer/drills.py`): a plan runs no engine process, so there is none to kill."""
        return -1


class LedgerRunner:
    """The episode runner: every rollout records the rollout phase and returns episodes of the longest length
    the budgets allow (rewards alternate inside a group, so every group carries a signal)."""

    def __init__(self, ledger: Ledger, tokens: int) -> None:
        self.ledger, self.tokens = ledger, tokens
        self.evaluations = 0

    def sampling(self, temperature: float | None = None) -> SamplingParams | None:
        return None if temperature is None else SamplingParams(temperature=temperature)

    async def run_groups(
        self,
        tasks: list[Task],
        n: int,
        engine_for: Any,
        sampling: SamplingParams | None = None,
        concurrency: int | None = None,
        /,
        *,
        gate: GroupGate | None = None,
    ) -> list[EpisodeGroup]:
        phase = "rollout" if sampling is None else "evaluation"
        for url in sorted(self.ledger.empty_weights):
            self.ledger.complain(
                f"the {phase} runs on {url}, whose weights were released without a host copy and not pushed since "
                "(it would generate from garbage)"
            )
        self.ledger.record(phase)
        if sampling is not None:
            self.evaluations += 1  # each evaluation scores a little higher: every one exports a new best
        return [
            EpisodeGroup(f"g{i}", task, [self._episode(task, f"g{i}", k) for k in range(n)])
            for i, task in enumerate(tasks)
        ]

    def _episode(self, task: Task, group: str, k: int) -> Episode:
        episode = Episode(task, group, finish_reason="done")
        prompt = self.tokens // 2
        episode.append([0] * prompt, trained=False)
        episode.append([0] * (self.tokens - prompt), trained=True, turn=0)
        reward = float(k % 2) + self.evaluations / 1000
        episode.turns.append(Turn(0, prompt, self.tokens, "", reward=reward))
        return episode
