"""`userrl rollout` refuses bad input before starting any engine (the full command runs in test_pool_ray.py)."""

from pathlib import Path

import pytest

from tests.support.chatty import make_chatty_model
from userrl_megatron.cli import main


def test_a_tool_format_the_model_cannot_show_is_a_user_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = make_chatty_model(tmp_path / "model")
    capsys.readouterr()
    assert main(["rollout", "--limit", "1", f"model.path={model}", "model.tool_format=hermes"]) == 2
    assert capsys.readouterr().err == (
        f"userrl: error: the chat template of '{model}' ignores tools, so the policy would never see them; "
        "set model.tool_format=tags\n"
    )


def test_bad_counts(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["rollout", "--samples", "0"]) == 2
    assert capsys.readouterr().err == "userrl: error: --samples must be >= 1 and --limit >= 0, got 0 and 0\n"
