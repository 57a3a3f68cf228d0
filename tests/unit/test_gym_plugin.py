"""A gym from a package outside `gyms/`: gyms/README.md's CoinGym, installed as printed there.

The README's code becomes the package `coin_gym` in a temporary folder on sys.path, beside a `coin_gym-0.1.dist-info`
whose entry point (group `userrl_megatron.gyms`) names it, as `pip install` of its distribution would leave it. The
test then uses what a person and the trainer use: `userrl config show --explain`, `userrl config validate`, the
config loader, `load_tasks` (its procedural source), `config_for` and `make_gym`.
"""

import asyncio
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from gyms import base, config_for, make_gym
from userrl_megatron.cli import main
from userrl_megatron.config import load_config
from userrl_megatron.data import list_sources, load_tasks

README = Path(__file__).resolve().parents[2] / "gyms" / "README.md"


@pytest.fixture
def coin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The README's CoinGym installed from `tmp_path` (the folder); unregistered and forgotten afterwards."""
    section = README.read_text().split("## Adding a gym", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S)
    assert code, "gyms/README.md: the 'Adding a gym' section lost its example"
    (tmp_path / "coin_gym").mkdir()
    (tmp_path / "coin_gym" / "__init__.py").write_text(code.group(1))
    dist = tmp_path / "coin_gym-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: coin-gym\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[userrl_megatron.gyms]\ncoin = coin_gym\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        yield tmp_path
    finally:
        base.unregister_gym("coin")
        sys.modules.pop("coin_gym", None)


def test_the_installed_gym_is_explained(coin: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "show", "--explain", "gyms.coin.sides=3"]) == 0
    shown = capsys.readouterr().out
    assert "  coin:  # CoinGym, a coin to call" in shown
    assert "    sides: 3  # how many of heads, tails, edge the coin has" in shown
    assert "    reward: 1.0  # reward of a right call" in shown
    assert "coin-procedural" in list_sources()


def test_the_installed_gym_is_validated(coin: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good, bad, misspelt = coin / "good.yaml", coin / "bad.yaml", coin / "misspelt.yaml"
    good.write_text("gyms:\n  train: [coin-procedural]\n  coin:\n    sides: 3\n")
    bad.write_text("gyms:\n  coin:\n    sides: 5\n    reward: 2.0\n")
    misspelt.write_text("gyms:\n  coin:\n    side: 3\n")
    assert main(["config", "validate", str(good), str(bad), str(misspelt)]) == 1
    out, err = capsys.readouterr()
    assert out == f"ok   {good}\n"
    assert err.splitlines() == [
        f"userrl: error: {bad}: gyms.coin.reward must be in [0, 1], got 2.0",
        f"userrl: error: {bad}: gyms.coin.sides must be in 2..3, got 5",
        f"userrl: error: {misspelt}: {misspelt}: unknown key 'gyms.coin.side' (did you mean 'gyms.coin.sides'?)",
    ]


def test_the_installed_gym_plays_with_its_own_settings(coin: Path) -> None:
    cfg = load_config(overrides=["gyms.train=[coin-procedural]", "gyms.coin.sides=3", "gyms.coin.reward=0.5"])
    tasks = load_tasks(cfg.gyms.train, "train", cfg.gyms)
    assert [t.task_id for t in tasks] == ["coin-train-0", "coin-train-1", "coin-train-2", "coin-train-3"]
    settings = config_for("coin", cfg.gyms, 5)
    assert (settings.sides, settings.reward, settings.max_steps) == (3, 0.5, 5)
    assert base.gym_spec("coin").config_type is sys.modules["coin_gym"].CoinGymConfig

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


def test_without_the_package_the_section_is_unknown() -> None:
    assert "coin" not in base.list_gyms()
    with pytest.raises(Exception, match=r"unknown key 'gyms.coin'"):
        load_config(overrides=["gyms.coin.sides=3"])


def test_built_in_gyms_are_found_without_a_list() -> None:
    folders = sorted(p.parent.name for p in (README.parent).glob("*/__init__.py"))
    assert set(folders) <= {spec.split("_")[0] for spec in base.list_gyms()}
