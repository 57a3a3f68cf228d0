import dataclasses
from pathlib import Path

import pytest
import yaml

from userrl_megatron.algo import ADVANTAGE_ESTIMATORS, POLICY_LOSSES
from userrl_megatron.config import ConfigError, RootConfig, load_config, save_config, to_yaml
from userrl_megatron.config.checks import CHOICES
from userrl_megatron.config.docs import explain, field_docs

REPO = Path(__file__).resolve().parents[2]


def _write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_defaults_are_valid_and_typed() -> None:
    cfg = load_config()
    assert isinstance(cfg, RootConfig)
    assert cfg.algo.turn_level == "Equalized"
    assert isinstance(cfg.rollout.sglang.extra_args, list)


def test_an_unnamed_run_is_named_after_its_command_and_model() -> None:
    assert load_config().run.name == "train-smollm2-135m-instruct"
    assert load_config(overrides=["model.path=/models/Qwen3-8B/"], check=False).run.name == "train-Qwen3-8B"
    assert load_config(command="sft").run.name == "sft-smollm2-135m-instruct"
    assert load_config(overrides=["run.name=mine"], command="sft").run.name == "mine"
    assert load_config([REPO / "configs" / "quickstart.yaml"]).run.name == "quickstart"


def test_yaml_files_merge_in_order_then_overrides(tmp_path: Path) -> None:
    a = _write(tmp_path, "a.yaml", "rollout:\n  max_turns: 3\n  temperature: 0.5\nrun:\n  name: a\n")
    b = _write(tmp_path, "b.yaml", "rollout:\n  max_turns: 5\n")
    cfg = load_config([a, b], ["run.name=cli", "algo.gamma=0.5"])
    assert cfg.rollout.max_turns == 5  # b after a
    assert cfg.rollout.temperature == 0.5  # from a, untouched by b
    assert cfg.run.name == "cli"  # command line last
    assert cfg.algo.gamma == 0.5


def test_scientific_notation_and_lists_parse(tmp_path: Path) -> None:
    f = _write(tmp_path, "c.yaml", "megatron:\n  lr: 1e-6\nlogging:\n  backends: [console, tensorboard]\n")
    cfg = load_config([f])
    assert cfg.megatron.lr == pytest.approx(1e-6)
    assert cfg.logging.backends == ["console", "tensorboard"]


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("rollout.n_sample=2", "unknown key 'rollout.n_sample' (did you mean 'rollout.n_samples_per_prompt'?)"),
        ("rollout.lr=1", "unknown key 'rollout.lr' (did you mean 'megatron.lr'?)"),
        ("roll.max_turns=1", "unknown key 'roll' (did you mean 'rollout'?)"),
        ("rollout.max_turns=abc", "rollout.max_turns expects int, got 'abc' (str)"),
        ("rollout.sglang.base_port=x", "rollout.sglang.base_port expects int, got 'x' (str)"),
        ("algo.norm_by_std=maybe", "algo.norm_by_std expects bool"),
        ("novalue", "overrides must look like section.key=value"),
    ],
)
def test_bad_overrides_name_the_key(override: str, message: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(overrides=[override])
    assert message in str(e.value)


def test_unknown_key_in_yaml_names_file_and_key(tmp_path: Path) -> None:
    f = _write(tmp_path, "bad.yaml", "algo:\n  turn_levl: R2G\n")
    with pytest.raises(ConfigError, match=r"bad.yaml: unknown key 'algo.turn_levl' \(did you mean 'algo.turn_level'"):
        load_config([f])


def test_section_given_a_scalar_is_an_error(tmp_path: Path) -> None:
    f = _write(tmp_path, "bad.yaml", "algo: 3\n")
    with pytest.raises(ConfigError, match="algo must be a mapping"):
        load_config([f])


def test_missing_file_and_bad_yaml(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="config file not found"):
        load_config([tmp_path / "nope.yaml"])
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config([_write(tmp_path, "x.yaml", "a: [1,\n")])


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            [
                "megatron.tensor_model_parallel_size=2",
                "megatron.pipeline_model_parallel_size=2",
                "megatron.devices_per_node=6",
            ],
            "= 4 does not divide the actor device count megatron.nnodes x megatron.devices_per_node = 6",
        ),
        (["rollout.n_samples_per_prompt=1"], "rollout.n_samples_per_prompt must be > 1, got 1"),
        (
            ["rollout.max_prompt_tokens=1500", "rollout.max_response_tokens=1000"],
            "max_response_tokens = 1500 + 1000 exceeds model.max_context_length = 2048",
        ),
        (["algo.turn_level=Linear"], "algo.turn_level = 'Linear'; choose from Equalized, R2G, EM"),
        (["megatron.sequence_parallel=true"], "megatron.sequence_parallel needs tensor_model_parallel_size >= 2"),
        (["megatron.virtual_pipeline_model_parallel_size=2"], "needs pipeline_model_parallel_size >= 3, got 1"),
        (["algo.mini_batches_per_step=3"], "algo.mini_batches_per_step = 3 must divide the episodes per step"),
        (["megatron.devices_per_node=0"], "megatron.devices_per_node must be >= 1, got 0"),
        (["logging.backends=[console,mlflow]"], "logging.backends: unknown ['mlflow']"),
        (
            ["megatron.expert_model_parallel_size=2", "megatron.devices_per_node=2"],
            "megatron.expert_model_parallel_size = 2 needs a mixture-of-experts model; llama is dense (set it to 1)",
        ),
        (
            ["megatron.expert_model_parallel_size=2", "megatron.devices_per_node=3"],
            "megatron.expert_model_parallel_size = 2 must divide the data-parallel size 3",
        ),
        (["run.device=cpu", "megatron.context_parallel_size=2", "megatron.devices_per_node=2"], "needs CUDA"),
        (
            ["algo.routing_replay=rollout"],
            "algo.routing_replay = rollout needs a mixture-of-experts model; llama is dense (set it to none)",
        ),
        (["algo.routing_replay=all"], "algo.routing_replay = 'all'; choose from none, rollout"),
    ],
)
def test_cross_field_checks(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(overrides=overrides)
    assert message in str(e.value)


def test_all_problems_reported_together() -> None:
    with pytest.raises(ConfigError) as e:
        load_config(overrides=["algo.turn_level=X", "algo.trajectory_score=Y"])
    assert "algo.turn_level" in str(e.value) and "algo.trajectory_score" in str(e.value)


def test_valid_parallel_layout_passes() -> None:
    cfg = load_config(
        overrides=[
            "model.path=/models/Qwen3-8B",  # not on this machine: its published shape is checked
            "megatron.tensor_model_parallel_size=2",
            "megatron.pipeline_model_parallel_size=2",
            "megatron.nnodes=2",
            "megatron.devices_per_node=8",
        ]
    )
    assert cfg.megatron.nnodes * cfg.megatron.devices_per_node == 16


def test_every_field_has_a_doc_comment() -> None:
    def walk(node: object, prefix: str) -> list[str]:  # the defaults: every registered gym's section included
        missing = []
        for name, doc in field_docs(type(node)).items():
            if not doc:
                missing.append(prefix + name)
            if dataclasses.is_dataclass(getattr(node, name)):
                missing += walk(getattr(node, name), f"{prefix}{name}.")
        return missing

    assert walk(RootConfig(), "") == []
    assert "gyms.echo.turns" in explain_keys(RootConfig())


def explain_keys(cfg: RootConfig) -> set[str]:
    """The dotted keys `config show --explain` lists."""

    def walk_dict(node: dict[str, object], prefix: str) -> set[str]:
        keys: set[str] = set()
        for name, value in node.items():
            keys |= walk_dict(value, f"{prefix}{name}.") if isinstance(value, dict) else {f"{prefix}{name}"}
        return keys

    return walk_dict(yaml.safe_load(explain(cfg)), "")


def test_explain_is_yaml_with_the_same_values() -> None:
    cfg = load_config(overrides=["rollout.max_turns=7", "logging.backends=[console,wandb]"])
    text = explain(cfg)
    assert "max_turns: 7  # assistant turns per episode" in text
    assert yaml.safe_load(text) == yaml.safe_load(to_yaml(cfg))


def test_saved_config_loads_back_identically(tmp_path: Path) -> None:
    cfg = load_config(overrides=["run.name=x", "algo.turn_level=EM", "gyms.travel.preference_correct_reward=0.6"])
    save_config(cfg, tmp_path / "config.yaml")
    assert load_config([tmp_path / "config.yaml"]) == cfg


def test_choices_match_the_registries() -> None:
    assert set(CHOICES["algo.adv_estimator"]) == set(ADVANTAGE_ESTIMATORS)
    assert set(CHOICES["algo.policy_loss"]) == set(POLICY_LOSSES) - {"sft_nll"}  # `userrl sft`'s loss, not an RL choice


def test_repository_configs_validate() -> None:
    files = sorted((REPO / "configs").glob("*.yaml")) + sorted((REPO / "configs" / "model").glob("*.yaml"))
    files += sorted((REPO / "examples").glob("*/config*.yaml"))
    assert len(files) >= 6, "no configs found"
    for f in files:
        load_config([f])
    layouts = sorted((REPO / "configs" / "layout").glob("*.yaml"))
    assert layouts
    for layout in layouts:  # each is meant for the model its name starts with
        model = REPO / "configs" / "model" / f"{layout.name.split('-h')[0]}.yaml"
        load_config([model, layout])
