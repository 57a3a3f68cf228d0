"""The two sides of the differential run: scripted LLM replies shared by both, UserRL's gym classes imported
from a checkout with their clients replaced, and one step's outcome on each side."""

import asyncio
import collections
import contextlib
import dataclasses
import hashlib
import importlib
import io
import os
import shutil
import sys
import types
from pathlib import Path
from typing import Any

FAIL = "<<simulator failure>>"  # a scripted reply meaning: the call fails (every retry)
TAGS = ("[action]", "[answer]", "[search]", "[finish]")


# --------------------------------------------------------------------------------------------------------------
# Scripted LLM replies, shared by both sides: each step sets one queue of reply texts per side.


class Script:
    def __init__(self) -> None:
        self.queues: dict[str, collections.deque[str]] = {"userrl": collections.deque(), "ours": collections.deque()}
        self.calls: dict[str, int] = {"userrl": 0, "ours": 0}
        self.unscripted: dict[str, int] = {"userrl": 0, "ours": 0}

    def set(self, replies: list[str], userrl_attempts: int = 1) -> None:
        """Queue `replies` on both sides; UserRL's side gets each failure `userrl_attempts` times (its retries)."""
        for side in self.queues:
            attempts = userrl_attempts if side == "userrl" else 1
            self.queues[side] = collections.deque(r for r in replies for _ in range(attempts if r == FAIL else 1))
            self.calls[side] = 0
            self.unscripted[side] = 0

    def next(self, side: str, messages: list[dict[str, Any]]) -> str:
        self.calls[side] += 1
        if not self.queues[side]:
            self.unscripted[side] += 1
            return FAIL
        return self.queues[side].popleft()


SCRIPT = Script()


class _Completions:
    def __init__(self, asynchronous: bool) -> None:
        self.asynchronous = asynchronous

    def _reply(self, messages: list[dict[str, Any]]) -> Any:
        text = SCRIPT.next("userrl", messages)
        if text == FAIL:
            raise RuntimeError("scripted simulator failure")
        message = types.SimpleNamespace(content=text, role="assistant")
        return types.SimpleNamespace(choices=[types.SimpleNamespace(message=message)])

    def create(self, **kwargs: Any) -> Any:
        if self.asynchronous:

            async def reply() -> Any:
                return self._reply(kwargs["messages"])

            return reply()
        return self._reply(kwargs["messages"])


class FakeOpenAI:
    asynchronous = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.chat = types.SimpleNamespace(completions=_Completions(self.asynchronous))


class FakeAsyncOpenAI(FakeOpenAI):
    asynchronous = True


class ScriptedSim:
    """Our side: `chat` as gyms.user_sim.UserSimulator's, answering from the script (a failure: UserSimError)."""

    async def chat(self, messages: list[dict[str, Any]], *, temperature: Any = None, max_tokens: Any = None,
                   json: bool = False, schema: Any = None) -> Any:  # fmt: skip
        from gyms.reply_json import extract_json_object, strip_think
        from gyms.user_sim import Reply, UserSimError

        text = SCRIPT.next("ours", messages)
        if text == FAIL:
            raise UserSimError("scripted simulator failure", "http", 3)
        text = strip_think(text)
        data = extract_json_object(text) if json else None
        if json and data is None:
            raise UserSimError(f"no JSON object in reply: {text[:200]!r}", "bad_json", 3)
        return Reply(text=text, data=data)

    async def close(self) -> None:
        pass


async def _no_sleep(*args: Any, **kwargs: Any) -> None:
    return None


class _AsyncioProxy(types.ModuleType):
    """The asyncio module with `sleep` returning at once (UserRL sleeps 2 s between failed LLM attempts)."""

    def __getattr__(self, name: str) -> Any:
        return _no_sleep if name == "sleep" else getattr(asyncio, name)


class _TimeProxy(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        import time

        return (lambda *a: None) if name == "sleep" else getattr(time, name)


def _patch_llm(module: Any) -> None:
    for name, fake in (("OpenAI", FakeOpenAI), ("AsyncOpenAI", FakeAsyncOpenAI)):
        if hasattr(module, name):
            setattr(module, name, fake)
    if hasattr(module, "openai"):  # IntentionGym calls `openai.AsyncOpenAI(...)` through the module
        module.openai = types.SimpleNamespace(OpenAI=FakeOpenAI, AsyncOpenAI=FakeAsyncOpenAI)
    if hasattr(module, "asyncio"):
        module.asyncio = _AsyncioProxy("asyncio")
    if hasattr(module, "time"):
        module.time = _TimeProxy("time")


# --------------------------------------------------------------------------------------------------------------
# Importing UserRL


def stub_gymnasium() -> None:
    try:
        importlib.import_module("gymnasium")
        return
    except ImportError:
        pass

    class Space:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            pass

    class Env:
        def reset(self, *, seed: Any = None, options: Any = None) -> Any:
            return None

    gym = types.ModuleType("gymnasium")
    spaces = types.ModuleType("gymnasium.spaces")
    for name in ("Discrete", "Dict", "Text", "Box", "MultiDiscrete", "Sequence", "Tuple", "MultiBinary"):
        setattr(spaces, name, type(name, (Space,), {}))
    gym.Env = Env  # type: ignore[attr-defined]
    gym.spaces = spaces  # type: ignore[attr-defined]
    gym.register = lambda *a, **k: None  # type: ignore[attr-defined]
    sys.modules["gymnasium"] = gym
    sys.modules["gymnasium.spaces"] = spaces


USERRL_PACKAGES = {
    "function": ("FunctionGym", "functiongym", ["functiongym.env.function_env"]),
    "turtle": ("TurtleGym", "turtlegym", ["turtlegym.env.prompts"]),
    "telepathy": ("TelepathyGym", "telepathygym", ["telepathygym.env.prompts"]),
    "search": ("SearchGym", "searchgym", ["searchgym.env.prompts", "searchgym.utils"]),
    "travel": ("TravelGym", "travelgym", ["travelgym.env.prompts", "travelgym.env.prompt_async"]),
    "intention": ("IntentionGym", "intentiongym", ["intentiongym.env.prompts"]),
    "persuade": ("PersuadeGym", "persuadegym", ["persuadegym.env.prompts"]),
}


def import_userrl(userrl: Path, gym: str, data_dir: Path) -> Any:
    """UserRL's package of `gym`, its LLM clients scripted; its data files checked against the data folder."""
    folder, package, llm_modules = USERRL_PACKAGES[gym]
    root = userrl / "gyms" / folder
    if not root.is_dir():
        raise SystemExit(f"{root} not found: --userrl must be a UserRL checkout")
    ours = data_dir / "userrl" / "gyms" / folder / package / "data"
    theirs = root / package / "data"
    for path in sorted(ours.glob("*")) if ours.is_dir() else []:
        target = theirs / path.name
        if not target.exists():
            theirs.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, target)
        elif _sha(target) != _sha(path):
            raise SystemExit(f"{target} differs from {path}: the checkout is not UserRL cf55a30's data")
    if gym == "search":
        os.environ.setdefault("SERPER_API_KEY", "scripted")
    sys.path.insert(0, str(root))
    module = importlib.import_module(package)
    for name in llm_modules:
        _patch_llm(importlib.import_module(name))
    return module


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# --------------------------------------------------------------------------------------------------------------
# One step on each side


@dataclasses.dataclass
class Outcome:
    feedback: str
    reward: float
    done: bool
    truncated: bool
    error: str = ""  # an exception the side raised
    info: dict[str, Any] = dataclasses.field(default_factory=dict)  # our StepResult.info (empty for UserRL)
    sim_error: bool = False  # our side: the step's simulator call failed for good (StepResult.user_sim_error)

    @property
    def ended(self) -> bool:
        return self.done or self.truncated


async def userrl_step(env: Any, action: str) -> Outcome:
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # UserRL prints its LLM errors
            obs, reward, terminated, truncated, _ = await env.step_async(action)
    except Exception as e:  # recorded as a difference
        return Outcome("", 0.0, False, False, f"{type(e).__name__}: {e}")
    feedback = obs.get("feedback", "") if isinstance(obs, dict) else str(obs)
    return Outcome(str(feedback), float(reward), bool(terminated), bool(truncated))


async def our_step(gym: Any, action: str) -> Outcome:
    try:
        r = await gym.step(action)
    except Exception as e:
        return Outcome("", 0.0, False, False, f"{type(e).__name__}: {e}")
    return Outcome(r.feedback, float(r.reward), r.done, r.truncated, info=r.info, sim_error=bool(r.user_sim_error))
