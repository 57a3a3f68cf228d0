"""The gym protocol, its step result, the action grammar and the registry.

One gym instance per episode. Gyms are async (a step may call the user simulator), never build LLM clients
(the simulator is injected), and never raise on bad actions: they answer with feedback and reward 0.
"""

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

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


def parse_action(action: str) -> tuple[str | None, str]:
    """Split "[tag] payload" into ("tag", "payload"); (None, text) when the action has no known tag."""
    m = _TAG.match(action)
    if m is None:
        return None, action.strip()
    return m.group(1).lower(), action[m.end() :].strip()


GymFactory = Callable[..., Gym]


@dataclass(frozen=True)
class GymSpec:
    """A registered gym: how to build it, where its config lives, how to get its tasks and smoke episodes."""

    name: str
    factory: GymFactory  # (task, config=None, user_sim=None) -> Gym; task: a task id, a record dict or a Task
    config_field: str  # attribute of GymsConfig holding this gym's typed config (gyms.config_for)
    config_type: type | None = None  # a gym outside the schema: its settings' dataclass, read from gyms.plugins
    needs_user_sim: bool = False  # steps may call the user simulator
    userrl_env: str = ""  # UserRL `env_name` of its parquet rows ("FunctionGym"), for the mixtures
    tasks: Callable[[str, Path], list[Task]] | None = None  # (split, data_dir) -> the public-data tasks of a split
    smoke: Callable[[], list[Any]] | None = None  # scripted episodes for `userrl gym smoke` (gyms.smoke.SmokeEpisode)


_REGISTRY: dict[str, GymSpec] = {}


def register_gym(
    name: str,
    *,
    config_field: str | None = None,
    config_type: type | None = None,
    needs_user_sim: bool = False,
    userrl_env: str = "",
    tasks: Callable[[str, Path], list[Task]] | None = None,
    smoke: Callable[[], list[Any]] | None = None,
) -> Callable[[GymFactory], GymFactory]:
    """Register a gym factory `(task, config=None, user_sim=None) -> Gym` under `name`.

    `config_field` names the GymsConfig attribute with the gym's config (default: `name`); gyms sharing one
    config section (tau_retail, tau_airline -> tau) pass it explicitly. A gym whose config is not a field of
    GymsConfig (a plug-in: one folder under `gyms/`) passes `config_type`, its settings' dataclass: its settings
    are `gyms.plugins.<config_field>.<setting>` in the run config, checked against that dataclass.
    """

    def wrap(factory: GymFactory) -> GymFactory:
        if name in _REGISTRY:
            raise ValueError(f"gym {name!r} is already registered")
        _REGISTRY[name] = GymSpec(
            name, factory, config_field or name, config_type, needs_user_sim, userrl_env, tasks=tasks, smoke=smoke
        )
        return factory

    return wrap


def list_gyms() -> list[str]:
    """Names of every registered gym."""
    _import_builtin_gyms()
    return sorted(_REGISTRY)


def gym_spec(name: str) -> GymSpec:
    """The registry entry of gym `name`; KeyError naming the known gyms otherwise."""
    _import_builtin_gyms()
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


def _import_builtin_gyms() -> None:
    from gyms.catalog import import_gym_packages

    import_gym_packages()
