"""The gym protocol, its step result, the action grammar and the registry.

One gym instance per episode. Gyms are async (a step may call the user simulator), never build LLM clients
(the simulator is injected), and never raise on bad actions: they answer with feedback and reward 0.
"""

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

ACTION_TAGS = ("[action]", "[answer]", "[search]", "[finish]")
_TAG = re.compile(r"^\s*\[(action|answer|search|finish)\]", re.IGNORECASE)


@dataclass
class StepResult:
    """What one gym step returns to the rollout."""

    feedback: str  # text shown to the policy
    reward: float  # this turn's reward
    done: bool = False  # the episode ended (solved, finished, or failed for good)
    truncated: bool = False  # the step limit was reached
    info: dict[str, Any] = field(default_factory=dict)  # e.g. {"user_sim_error": "..."} when the simulator failed

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
_REGISTRY: dict[str, GymFactory] = {}


def register_gym(name: str) -> Callable[[GymFactory], GymFactory]:
    """Register a gym factory `(task, config=None, user_sim=None) -> Gym` under `name`."""

    def wrap(factory: GymFactory) -> GymFactory:
        if name in _REGISTRY:
            raise ValueError(f"gym {name!r} is already registered")
        _REGISTRY[name] = factory
        return factory

    return wrap


def list_gyms() -> list[str]:
    """Names of every registered gym."""
    _import_builtin_gyms()
    return sorted(_REGISTRY)


def make_gym(name: str, task: Any, config: Any = None, user_sim: Any = None) -> Gym:
    """Build gym `name` for one task (a task id or a task record), with an optional config and user simulator."""
    _import_builtin_gyms()
    if name not in _REGISTRY:
        raise KeyError(f"unknown gym {name!r}; known gyms: {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name](task, config=config, user_sim=user_sim)


def _import_builtin_gyms() -> None:
    import gyms.catalog  # noqa: F401  (its imports register every built-in gym)
