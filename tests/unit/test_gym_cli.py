"""`userrl gym ...` and `userrl data ...` through the real CLI entry point."""

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from gyms.base import gym_spec, list_gyms
from tests.support.openai_server import Fault, OpenAIServer, when
from userrl_megatron.cli import main
from userrl_megatron.data.fetch import manifest

REPO = Path(__file__).resolve().parents[2]


def test_gym_list(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["gym", "list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines[1:]] == list_gyms()
    function = next(line for line in lines[1:] if line.split()[0] == "function")
    assert function.split()[:3] == ["function", "no", "gyms.function"]


def test_gym_smoke_runs_every_gym(
    shared_data: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("USERRL_DATA_DIR", str(shared_data))  # gyms whose smoke episodes read the data find it
    episodes = sum(len(gym_spec(name).smoke()) for name in list_gyms())
    assert main(["gym", "smoke"]) == 0
    out = capsys.readouterr().out
    assert out.rstrip().endswith(f"{episodes}/{episodes} smoke episodes passed")
    assert {line.split()[0] for line in out.splitlines()[1:-1]} == set(list_gyms())


def test_gym_smoke_rejects_unknown_gyms(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["gym", "smoke", "--gym", "chess"]) == 2
    assert "unknown gym(s) ['chess']" in capsys.readouterr().err


def test_gym_play_function(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from gyms.function.rules import generate_function
    from gyms.function.settings import FunctionGeneratorConfig

    record = generate_function(FunctionGeneratorConfig(), "test", 0)
    monkeypatch.setattr(sys, "stdin", io.StringIO(f"[search] test\n\n[answer] {record['expected_result']}\nignored\n"))
    assert main(["gym", "play", "function"]) == 0
    out = capsys.readouterr().out
    assert "[system]\nYou are an agent interacting with an environment" in out
    assert f"Test case: {record['test_case']}\nReward: 0.0" in out
    assert "Your answer is correct!\nReward: 1.0\nThe episode ended (done)." in out
    assert out.rstrip().endswith("Episode return: 1.0")


def test_gym_play_uses_the_configured_simulator(
    shared_data: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(sys, "stdin", io.StringIO("[action] Is it a fruit?\n"))
    with OpenAIServer(when("game master", '{"response": "Yes"}')) as server:
        args = ["gym", "play", "telepathy", "--task", "kiwi", f"gyms.data_dir={shared_data}"]
        sim = [f"user_sim.base_url={server.base_url}", "user_sim.model=judge-7b", "user_sim.api_key_env=none"]
        assert main([*args, *sim]) == 0
    assert server.requests[0]["model"] == "judge-7b"
    out = capsys.readouterr().out
    assert "I am thinking of a fruit." in out and "Yes\nReward: 0.0" in out and "Episode return: 0.0" in out


def test_gym_play_a_tau2_conversation_opens_with_the_simulated_user(
    shared_data: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(sys, "stdin", io.StringIO("[action] Which t-shirts? ###STOP###\n"))
    args = ["gym", "play", "tau2_retail", "--task", "24", f"gyms.data_dir={shared_data}", "user_sim.api_key_env=none"]
    with OpenAIServer(when("<scenario>", "Hi, which t-shirts did I order?")) as server:
        assert main([*args, f"user_sim.base_url={server.base_url}"]) == 0
    out = capsys.readouterr().out
    assert "[assistant]\nHi! How can I help you today?" in out and "Hi, which t-shirts did I order?" in out
    assert "Episode return: 1.0" in out  # no actions and no judge: DB alone, which holds
    with OpenAIServer(when("<scenario>", Fault(400))) as server:
        assert main([*args, f"user_sim.base_url={server.base_url}"]) == 2
    assert "tau2_retail: the user simulator failed at the start of the episode" in capsys.readouterr().err


def test_gym_play_unknown_task(shared_data: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = [
        "gym",
        "play",
        "turtle",
        "--task",
        "No Such Story",
        f"gyms.data_dir={shared_data}",
        "user_sim.api_key_env=none",
    ]
    assert main(args) == 2
    assert "cannot start turtle on task 'No Such Story'" in capsys.readouterr().err


def test_data_fetch_verify_build(shared_data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    dest = tmp_path / "data"
    n = len(manifest(("userrl",)))
    assert main(["data", "fetch", "--from", str(shared_data), "--dest", str(dest), "--only", "userrl"]) == 0
    assert capsys.readouterr().out.strip() == f"data in {dest}: {n} copied; every file matches its sha256"
    assert main(["data", "verify", "--dir", str(dest), "--only", "userrl"]) == 0
    (dest / "userrl/LICENSE.txt").write_text("changed")
    assert main(["data", "verify", "--dir", str(dest), "--only", "userrl"]) == 1
    captured = capsys.readouterr()
    assert "corrupt  userrl/LICENSE.txt" in captured.out and f"{n - 1}/{n} files ok" in captured.out
    assert "fix with `userrl data fetch`" in captured.err
    out = tmp_path / "rows"
    args = ["data", "build", "--out", str(out), "--source", "intention", "--format", "jsonl", f"gyms.data_dir={dest}"]
    assert main(args) == 0
    assert capsys.readouterr().out.splitlines()[1:3] == [
        f"{'intention':22s} {'train':6s} {380:6d}",
        f"{'intention':22s} {'test':6s} {40:6d}",
    ]
    first = json.loads((out / "intention" / "test.jsonl").read_text().splitlines()[0])
    assert first["task_id"] == "06c2b5dd-7750-4cb6-8aad-1ff6554b98fb"
    assert not (out / "intention" / "test.parquet").exists()


def test_data_errors_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["data", "fetch", "--from", str(tmp_path / "nope"), "--dest", str(tmp_path)]) == 2
    assert f"--from {tmp_path / 'nope'}: not a directory" in capsys.readouterr().err
    assert main(["data", "build", "--source", "travel", f"gyms.data_dir={tmp_path}"]) == 2
    assert "run `userrl data fetch`" in capsys.readouterr().err


def test_help_stays_light() -> None:
    code = (
        "import sys\nfrom userrl_megatron.cli import main\n"
        "try:\n    main(['gym', '--help'])\nexcept SystemExit:\n    pass\n"
        "print('HEAVY', [m for m in ('openai', 'pyarrow', 'aiohttp', 'torch') if m in sys.modules])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO).stdout
    assert "HEAVY []" in out
