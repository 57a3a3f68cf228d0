"""A gym added as one folder: gyms/README.md's CoinGym, run as printed there.

Its code is read from the README and executed as the module `gyms.coin.env` would be (registering the gym); the
test then drives it through what the trainer uses: the config (`gyms.plugins.coin`), `load_tasks`, `config_for`,
`make_gym`, and the episode runner's typed failure field.
"""

import asyncio
import re
import sys
import types
from collections.abc import Iterator
from pathlib import Path

import pytest

from gyms import base, config_for, make_gym
from userrl_megatron.config import load_config
from userrl_megatron.data import load_tasks
from userrl_megatron.errors import UserError

README = Path(__file__).resolve().parents[2] / "gyms" / "README.md"


@pytest.fixture
def coin() -> Iterator[types.ModuleType]:
    section = README.read_text().split("## Adding a gym", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S)
    assert code, "gyms/README.md: the 'Adding a gym' section lost its example"
    module = types.ModuleType("gyms_readme_coin")
    sys.modules[module.__name__] = module  # dataclasses look their module up
    try:
        exec(compile(code.group(1), str(README), "exec"), module.__dict__)
        yield module
    finally:
        base._REGISTRY.pop("coin", None)
        sys.modules.pop(module.__name__, None)


def test_the_readme_gym_trains_with_its_own_settings(coin: types.ModuleType) -> None:
    cfg = load_config(overrides=["gyms.train=[coin]", "gyms.plugins.coin.sides=3", "gyms.plugins.coin.reward=0.5"])
    tasks = load_tasks(cfg.gyms.train, "train", cfg.gyms)
    assert [t.task_id for t in tasks] == ["coin-train-0", "coin-train-1", "coin-train-2", "coin-train-3"]
    settings = config_for("coin", cfg.gyms, 5)
    assert settings == coin.CoinGymConfig(sides=3, reward=0.5, max_steps=5)

    async def play() -> list[tuple[str, float, bool]]:
        gym = make_gym("coin", tasks[1], settings)
        await gym.reset()
        steps = [await gym.step(action) for action in ("[action] hm", "[answer] heads", "[answer] Tails")]
        return [(s.feedback, s.reward, s.done) for s in steps]

    assert asyncio.run(play()) == [
        ("Call it: [answer] one of heads, tails, edge.", 0.0, False),
        ("Wrong.", 0.0, False),
        ("Right!", 0.5, True),
    ]
    assert base.gym_spec("coin").config_type is coin.CoinGymConfig


def test_a_misspelt_setting_fails_when_the_tasks_load(coin: types.ModuleType) -> None:
    cfg = load_config(overrides=["gyms.train=[coin]", "gyms.plugins.coin.side=3"])
    with pytest.raises(
        UserError, match=r"^gyms.plugins.coin: unknown setting\(s\) side; valid: max_steps, reward, sides$"
    ):
        load_tasks(cfg.gyms.train, "train", cfg.gyms)


def test_settings_that_do_not_fit_together_fail_when_the_tasks_load(coin: types.ModuleType) -> None:
    cfg = load_config(overrides=["gyms.train=[coin]", "gyms.plugins.coin.sides=5"])
    with pytest.raises(UserError, match=r"^gyms.plugins.coin.sides must be in 2..3, got 5$"):
        load_tasks(cfg.gyms.train, "train", cfg.gyms)


def test_built_in_gyms_are_found_without_a_list() -> None:
    folders = sorted(p.parent.name for p in (README.parent).glob("*/__init__.py"))
    assert set(folders) <= {spec.split("_")[0] for spec in base.list_gyms()}
