"""The gyms config section: typed per-gym configs, config_for, cross-field checks, live smoke runs."""

import dataclasses

import pytest

import gyms
from gyms.smoke import run_smoke
from tests.support.gym_play import sim_for
from tests.support.openai_server import OpenAIServer, reply
from userrl_megatron.config import ConfigError, load_config
from userrl_megatron.config.schema import GymsConfig


def test_every_gym_has_its_config_section() -> None:
    cfg = GymsConfig()
    for name in gyms.list_gyms():
        field = gyms.gym_spec(name).config_field
        section = getattr(cfg, field)
        default_steps = section.max_steps
        built = gyms.config_for(name, cfg, 7)
        assert dataclasses.is_dataclass(built) and built.max_steps == 7 and section.max_steps == default_steps
        assert dataclasses.replace(built, max_steps=default_steps) == section


def test_every_numeric_gym_setting_has_a_range() -> None:
    def unranged(settings: object, prefix: str) -> list[str]:
        found = []
        for f in dataclasses.fields(settings):  # type: ignore[arg-type]
            value = getattr(settings, f.name)
            if dataclasses.is_dataclass(value):
                found += unranged(value, f"{prefix}{f.name}.")
            elif f.type in (int, float, "int", "float") and f.name not in getattr(settings, "RANGES", {}):
                found.append(f"{prefix}{f.name}")
        return found

    cfg = GymsConfig()
    sections = {gyms.gym_spec(name).config_field for name in gyms.list_gyms()}
    assert [key for section in sorted(sections) for key in unranged(getattr(cfg, section), f"{section}.")] == []


def test_gym_settings_load_from_overrides() -> None:
    cfg = load_config(
        overrides=[
            "gyms.function.generator.terms=3",
            "gyms.function.generator.operators=['+','*']",  # quoted: * is YAML syntax
            "gyms.travel.preference_correct_reward=0.6",
            "gyms.persuade.reward_baseline=previous",
            "user_sim.http_backend=httpx",
        ]
    )
    assert cfg.gyms.function.generator.terms == 3 and cfg.gyms.function.generator.operators == ["+", "*"]
    assert gyms.config_for("travel", cfg.gyms, 16).preference_correct_reward == 0.6
    assert cfg.gyms.persuade.reward_baseline == "previous"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["gyms.function.generator.terms=5"], "gyms.function.generator.terms must be in 1..4"),
        (["gyms.function.generator.operators=['+','%']"], "gyms.function.generator.operators: unknown ['%']"),
        (
            ["gyms.function.generator.terms=2", "gyms.function.generator.operators=['**']"],
            "gyms.function.generator.operators needs one of + - * / when terms > 1",
        ),
        (
            ["gyms.function.generator.balanced=true", "gyms.function.generator.max_input=3"],
            "gyms.function.generator.balanced needs four distinct inputs: max_input >= 4, got 3",
        ),
        (
            ["gyms.persuade.reward_baseline=worst"],
            "gyms.persuade.reward_baseline = 'worst'; choose from best, previous",
        ),
        (["gyms.search.backend=bing"], "gyms.search.backend = 'bing'; choose from offline, web"),
        (["gyms.search.judge=human"], "gyms.search.judge = 'human'; choose from llm, exact"),
        (["user_sim.http_backend=curl"], "user_sim.http_backend = 'curl'; choose from aiohttp, httpx"),
        (["gyms.travel.elicitation_interval=0"], "gyms.travel.elicitation_interval must be >= 1, got 0"),
        (["gyms.echo.turns=0"], "gyms.echo.turns must be >= 1, got 0"),
        (["gyms.function.generator.prompt_style=terse"], "gyms.function.generator.prompt_style = 'terse'; choose"),
        (["user_sim.max_concurrency=0"], "user_sim.max_concurrency must be >= 1, got 0"),
        (["gyms.options={}"], "unknown key 'gyms.options'"),
    ],
)
def test_bad_gym_settings_name_the_key(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(overrides=overrides)
    assert message in str(e.value)


def test_live_smoke_checks_only_that_nothing_crashes() -> None:
    with OpenAIServer(reply('{"response": "Yes", "judgment": "No", "feedback": "no"}')) as server:
        sim = sim_for(server)
        results = run_smoke(["telepathy"], sim)
    assert [(r.ok, r.total_reward) for r in results] == [(True, 0.0), (True, 0.0)]  # the guess was judged wrong
    assert sim.metrics()["calls"] == 4.0


def test_the_typed_section_survives_pickling_copies_and_replace() -> None:
    import copy
    import pickle

    from ray import cloudpickle

    cfg = load_config(overrides=["gyms.echo.turns=5", "gyms.train=[echo-procedural]"])
    for copied in (pickle.loads(pickle.dumps(cfg)), cloudpickle.loads(cloudpickle.dumps(cfg)), copy.deepcopy(cfg)):
        assert copied == cfg and copied.gyms.echo.turns == 5
    assert dataclasses.replace(cfg.gyms, data_dir="/d").echo.turns == 5
    assert isinstance(cfg.gyms, GymsConfig) and GymsConfig(data_dir="/d").function.generator.terms == 1
