"""The `gyms` section, typed from the registered gyms, and the user simulator's settings (`UserSimConfig`, section
`user_sim`).

Every gym is a plug-in: its package (a folder under `gyms/` or an installed package named in the entry-point group
`userrl_megatron.gyms`) brings its settings dataclass and registers it here when it registers itself
(`gyms.register_gym`). This package imports no gym: a higher layer adds the finder that imports them
(`add_gym_finder`, `userrl_megatron/__init__.py`), and `GymsConfig()` is then a dataclass with one typed field per
registered section (`gyms_config_type`), which the loader checks keys and types against, `config show --explain`
documents (the settings dataclass's docstring and field comments) and `config validate` checks
(`settings_problems`: the settings' own `RANGES`, `CHOICES` and `problems(where)`).
"""

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from userrl_megatron.config.rules import YAML_ON_OFF, Rule, choice_problem, range_problem

_SETTINGS: dict[str, type] = {}  # section -> settings dataclass, in registration order
_FINDERS: list[Callable[[], None]] = []
_TYPED: dict[tuple[tuple[str, type], ...], type] = {}
_finding = False


def add_gym_finder(finder: Callable[[], None]) -> None:
    """Add `finder`, which registers gyms (importing them); it runs, idempotently, whenever the sections are read."""
    if finder not in _FINDERS:
        _FINDERS.append(finder)


def register_gym_settings(section: str, settings: type) -> None:
    """Register `settings`, a dataclass, as the type of config section `gyms.<section>` (gyms sharing a section
    share the type)."""
    if not dataclasses.is_dataclass(settings):
        raise TypeError(f"the settings of gyms.{section} must be a dataclass, got {settings!r}")
    if section in BASE_FIELDS:
        raise ValueError(f"gyms.{section} is not a gym section: {', '.join(BASE_FIELDS)} are taken")
    known = _SETTINGS.setdefault(section, settings)
    if known is not settings:
        raise ValueError(f"gyms.{section} is already typed by {known.__qualname__}, not {settings.__qualname__}")


def forget_gym_settings(section: str) -> None:
    """Drop section `gyms.<section>` (its gyms were unregistered)."""
    _SETTINGS.pop(section, None)


def gym_settings() -> dict[str, type]:
    """Section -> settings dataclass of every registered gym (the finders run first)."""
    global _finding
    if not _finding:
        _finding = True
        try:
            for finder in _FINDERS:
                finder()
        finally:
            _finding = False
    return dict(_SETTINGS)


def gyms_config_type() -> type["GymsConfig"]:
    """`GymsConfig` with one field per registered gym section, each defaulting to its settings' defaults (one class
    per set of sections)."""
    sections = tuple(gym_settings().items())
    if sections not in _TYPED:
        fields = [
            (name, settings, field(default_factory=settings, metadata={"doc": section_doc(settings)}))
            for name, settings in sections
        ]
        _TYPED[sections] = dataclasses.make_dataclass(
            "GymsConfig", fields, bases=(GymsConfig,), namespace={"__module__": __name__}
        )
    return _TYPED[sections]


def section_doc(settings: type) -> str:
    """The first line of a settings dataclass's docstring (a dataclass without one: its name)."""
    doc = settings.__doc__ or ""
    return settings.__name__ if doc.startswith(f"{settings.__name__}(") else doc.strip().split("\n")[0].rstrip(".")


def typed_gyms_config(values: dict[str, Any]) -> "GymsConfig":
    """A `GymsConfig` of the registered sections holding `values` (how a pickled one is rebuilt)."""
    return gyms_config_type()(**values)


@dataclass
class GymsConfig:
    """The `gyms` section: the public data and task sources; `GymsConfig(...)` adds a field per registered gym."""

    data_dir: str = ""  # public data folder (`userrl data fetch`); empty = $USERRL_DATA_DIR or the default cache
    train: list[str] = field(default_factory=lambda: ["function-procedural"])  # training sources (userrl data list)
    test: list[str] = field(default_factory=lambda: ["function-procedural"])  # evaluation sources

    def __new__(cls, *args: Any, **kwargs: Any) -> "GymsConfig":
        """`GymsConfig(...)` builds the class typed with every registered gym's section (`gyms_config_type`)."""
        return super().__new__(gyms_config_type() if cls is GymsConfig else cls)

    def __reduce__(self) -> tuple[Callable[[dict[str, Any]], "GymsConfig"], tuple[dict[str, Any]]]:
        """Pickled as its values: the typed class is rebuilt from the registry where it is unpickled."""
        return typed_gyms_config, ({f.name: getattr(self, f.name) for f in dataclasses.fields(self)},)


BASE_FIELDS = tuple(f.name for f in dataclasses.fields(GymsConfig))


def settings_problems(settings: Any, where: str) -> list[str]:
    """What a settings dataclass finds wrong with itself, each message naming its key under `where`: its `RANGES`
    (field -> `config.rules.Rule`), its `CHOICES` (field -> allowed strings), its `problems(where)` (fields checked
    together), and the same of every dataclass among its fields, recursively."""
    if not dataclasses.is_dataclass(settings) or isinstance(settings, type):
        return []
    ranges: dict[str, Rule] = getattr(settings, "RANGES", {})
    choices: dict[str, tuple[str, ...]] = getattr(settings, "CHOICES", {})
    found = [range_problem(f"{where}.{name}", getattr(settings, name), rule) for name, rule in ranges.items()]
    found += [choice_problem(f"{where}.{name}", getattr(settings, name), allowed) for name, allowed in choices.items()]
    check = getattr(settings, "problems", None)
    problems = [problem for problem in found if problem] + (list(check(where)) if callable(check) else [])
    for f in dataclasses.fields(settings):
        problems += settings_problems(getattr(settings, f.name), f"{where}.{f.name}")
    return problems


@dataclass
class UserSimEnginesConfig:
    model: str = ""  # model the run serves as the user simulator ("": none, user_sim.base_url is used as it is)
    num_engines: int = 1  # frozen simulator engines (several: behind sglang-router)
    engine_tp: int = 1  # GPUs per simulator engine (tensor parallel)
    backend: str = ""  # "embedded" or "sglang"; "" = rollout.backend
    dtype: str = ""  # weight dtype of the simulator engines; "" = model.dtype
    mem_fraction_static: float = 0.0  # SGLang's share of each simulator GPU (weights + KV); 0 = rollout.sglang's
    context_length: int = 0  # longest prompt + reply a simulator engine serves; 0 = the simulator model's own
    placement: str = "own"  # "own": GPUs of their own; "policy_engines": on the policy engines' GPUs (docs/rollout.md)

    @property
    def shares_policy_engines(self) -> bool:
        """Served on the policy engines' GPUs (`placement: policy_engines`) rather than on GPUs of their own."""
        return bool(self.model) and self.placement == "policy_engines"


@dataclass
class UserSimConfig:
    base_url: str = "http://127.0.0.1:8000/v1"  # OpenAI-compatible endpoint of the user simulator / judge LLM
    model: str = "gpt-4o"  # model name sent to the endpoint
    api_key_env: str = "OPENAI_API_KEY"  # environment variable holding the API key ("none": a server without auth)
    temperature: float = 0.0  # sampling temperature of simulator calls
    max_tokens: int = 2048  # completion limit of one simulator call
    timeout_s: float = 30.0  # per-call timeout
    max_retries: int = 4  # retries after a timeout, 429 or 5xx before the call counts as failed
    backoff_s: float = 1.0  # first retry delay; doubles each retry, with jitter
    backoff_max_s: float = 30.0  # longest retry delay
    max_concurrency: int = 64  # simulator calls in flight at once
    cache_dir: str = ""  # on-disk response cache keyed by the request; empty disables it
    disable_thinking: bool = False  # send chat_template_kwargs.enable_thinking=false (Qwen3 on vLLM/SGLang)
    http_backend: str = "aiohttp"  # HTTP transport of the openai client: "aiohttp" (fast when busy) or "httpx"
    max_reply_chars: int = 100_000  # longer replies (thinking included) are a failed call, not episode text
    structured: str = "auto"  # ask for JSON-schema replies: on, off, auto (on until the endpoint first refuses them)
    structured_text_chars: int = 0  # a structured reply's free-text fields hold at most this many chars (0: no cap)
    engines: UserSimEnginesConfig = field(default_factory=UserSimEnginesConfig)  # simulator engines the run starts

    @property
    def structured_mode(self) -> str:
        """`structured` as auto/on/off: YAML reads a bare on/off as a boolean, which arrives here as "True"/"False"."""
        return YAML_ON_OFF.get(self.structured, self.structured)
