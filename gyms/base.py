"""The gym protocol, its step result, the action grammar and the registry.

One gym instance per episode. Gyms are async (a step may call the user simulator), never build LLM clients
(the simulator is injected), and never raise on bad actions: they answer with feedback and reward 0.
"""

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from userrl_megatron.config.gyms import forget_gym_settings, register_gym_settings
from userrl_megatron.types import Task

ACTION_TAGS = ("[action]", "[answer]", "[search]", "[finish]")
_TAG = re.compile(r"^\s*\[(action|answer|search|finish)\]", re.IGNORECASE)


@dataclass
class StepResult:
    """What one gym step returns to the rollout."""

    feedback: str  # text shown to the policy
    reward: float  # this turn's reward
    done: bool = False  # the episode ended (solved, finished, or failed for good)
    truncated: bool = False  # the step limit was reached
    info: dict[str, Any] = field(default_factory=dict)  # what the gym knows about the step (solved, score, ...)
    user_sim_error: str | None = None  # the user simulator failed for good on this step: the episode is not scored

    @property
    def ended(self) -> bool:
        """No further step is allowed."""
        return self.done or self.truncated


@runtime_checkable
class Gym(Protocol):
    """An environment instance for one episode."""

    name: str

    async def reset(self) -> str:
        """Start the episode; returns the initial observation text."""
        ...

    async def step(self, action: str) -> StepResult:
        """Apply one action string ("[action] ...", "[answer] ...", "[search] ...", "[finish]")."""
        ...

    async def close(self) -> None:
        """Release resources; idempotent."""
        ...


def opens_with_user_message(gym: Gym) -> bool:
    """Whether `gym.reset()` returns the user's first message, which then ends the policy's prompt. A gym says so
    with the class attribute `first_message_at_reset = True` (the tau2 gyms); other gyms' reset text is not shown."""
    return bool(getattr(gym, "first_message_at_reset", False))


def parse_action(action: str) -> tuple[str | None, str]:
    """Split "[tag] payload" into ("tag", "payload"); (None, text) when the action has no known tag."""
    m = _TAG.match(action)
    if m is None:
        return None, action.strip()
    return m.group(1).lower(), action[m.end() :].strip()


GymFactory = Callable[..., Gym]
ProceduralTasks = Callable[[str, Any], list[Task]]  # (split, the gym's settings) -> the tasks of a split


@dataclass(frozen=True)
class GymSpec:
    """A registered gym: how to build it, its settings, where they live, its task sources and smoke episodes."""

    name: str
    factory: GymFactory  # (task, config=None, user_sim=None) -> Gym; task: a task id, a record dict or a Task
    config_field: str  # its settings' config section, `gyms.<config_field>` (gyms.config_for)
    config_type: type  # its settings' dataclass (config/gyms.py `settings_problems` checks it)
    needs_user_sim: bool = False  # steps may call the user simulator
    userrl_env: str = ""  # UserRL `env_name` of its parquet rows ("FunctionGym"), for the mixtures
    tasks: Callable[[str, Path], list[Task]] | None = None  # (split, data_dir) -> the public-data tasks of a split
    smoke: Callable[[], list[Any]] | None = None  # scripted episodes for `userrl gym smoke` (gyms.smoke.SmokeEpisode)
    procedural: dict[str, ProceduralTasks] = field(default_factory=dict)  # sources made from its settings alone


_REGISTRY: dict[str, GymSpec] = {}


def register_gym(
    name: str,
    *,
    config_type: type,
    config_field: str | None = None,
    needs_user_sim: bool = False,
    userrl_env: str = "",
    tasks: Callable[[str, Path], list[Task]] | None = None,
    smoke: Callable[[], list[Any]] | None = None,
    procedural: dict[str, ProceduralTasks] | None = None,
) -> Callable[[GymFactory], GymFactory]:
    """Register a gym factory `(task, config=None, user_sim=None) -> Gym` under `name`.

    `config_type` is its settings' dataclass, the config section `gyms.<config_field>` (default: `name`; gyms
    sharing one section, tau_retail and tau_airline -> tau, pass it explicitly). `procedural` names the task sources
    generated from the settings alone (`{"echo-procedural": echo_tasks}`, `(split, settings) -> tasks`).
    """

    def wrap(factory: GymFactory) -> GymFactory:
        if name in _REGISTRY:
            raise ValueError(f"gym {name!r} is already registered")
        section = config_field or name
        register_gym_settings(section, config_type)
        _REGISTRY[name] = GymSpec(
            name, factory, section, config_type, needs_user_sim, userrl_env, tasks, smoke, dict(procedural or {})
        )
        return factory

    return wrap


def unregister_gym(name: str) -> None:
    """Forget gym `name`, and its settings section when no other gym shares it (tests that add a gym)."""
    spec = _REGISTRY.pop(name, None)
    if spec is not None and all(other.config_field != spec.config_field for other in _REGISTRY.values()):
        forget_gym_settings(spec.config_field)


def list_gyms() -> list[str]:
    """Names of every registered gym."""
    _find_gyms()
    return sorted(_REGISTRY)


def gym_spec(name: str) -> GymSpec:
    """The registry entry of gym `name`; KeyError naming the known gyms otherwise."""
    _find_gyms()
    if name not in _REGISTRY:
        raise KeyError(f"unknown gym {name!r}; known gyms: {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name]


def make_gym(name: str, task: Any, config: Any = None, user_sim: Any = None) -> Gym:
    """Build gym `name` for one task (a task id, a task record or a Task), with an optional config and simulator."""
    return gym_spec(name).factory(task, config=config, user_sim=user_sim)


def task_record(task: Any, lookup: Callable[[str], dict[str, Any]]) -> dict[str, Any]:
    """The record a gym runs on: a Task's `metadata["record"]`, a record dict as is, or `lookup(task_id)`."""
    if isinstance(task, Task):
        record = task.metadata.get("record")
        return dict(record) if isinstance(record, dict) else lookup(task.task_id)
    if isinstance(task, dict):
        return task
    if isinstance(task, str):
        return lookup(task)
    raise TypeError(f"a task is a task id, a record dict or a Task, got {type(task).__name__}")


def _find_gyms() -> None:
    from gyms.catalog import find_gyms

    find_gyms()
