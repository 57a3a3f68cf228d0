import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from userrl_megatron.cli import main


def test_help_imports_nothing_heavy() -> None:
    code = (
        "import sys\n"
        "from userrl_megatron.cli import main\n"
        "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
        "heavy = [m for m in ('torch', 'omegaconf', 'ray', 'transformers', 'megatron') if m in sys.modules]\n"
        "print('HEAVY', heavy)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "HEAVY []" in out
    assert "config" in out


def test_module_entry_point_runs() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "userrl_megatron", "config", "show", "run.name=m"], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    assert yaml.safe_load(result.stdout)["run"]["name"] == "m"


def test_config_show_prints_resolved_yaml(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    f = tmp_path / "a.yaml"
    f.write_text("algo:\n  gamma: 0.5\n")
    assert main(["config", "show", "--config", str(f), "rollout.max_turns=2"]) == 0
    shown = yaml.safe_load(capsys.readouterr().out)
    assert shown["algo"]["gamma"] == 0.5 and shown["rollout"]["max_turns"] == 2


def test_config_show_explain(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "show", "--explain"]) == 0
    out = capsys.readouterr().out
    assert "gamma: 0.8  # discount of R2G turn credits" in out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["rollout.n_sample=2"], "unknown key 'rollout.n_sample'"),
        (["rollout.max_turns=abc"], "rollout.max_turns expects int"),
        (["megatron.tensor_model_parallel_size=3", "megatron.devices_per_node=4"], "does not divide the actor device"),
    ],
)
def test_config_show_errors_exit_nonzero(capsys: pytest.CaptureFixture[str], args: list[str], message: str) -> None:
    assert main(["config", "show", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("userrl: error:") and message in err


def test_config_validate(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    good, bad = tmp_path / "good.yaml", tmp_path / "bad.yaml"
    good.write_text("rollout:\n  max_turns: 4\n")
    bad.write_text("rollout:\n  n_samples_per_prompt: 1\n")
    assert main(["config", "validate", str(good)]) == 0
    assert main(["config", "validate", str(good), str(bad)]) == 1
    captured = capsys.readouterr()
    assert f"ok   {good}" in captured.out
    assert captured.err.startswith(f"userrl: error: {bad}: algo.adv_estimator = grpo_multiturn normalises")
    assert "n_samples_per_prompt must be > 1" in captured.err
