import pytest

from userrl_megatron.types import Episode, EpisodeGroup, Message, SamplingParams, Task, Turn


def _episode() -> Episode:
    task = Task(gym="function", task_id="func-1", prompt=[Message("user", "hi")])
    return Episode(task=task, group_id="g")


def test_episode_append_keeps_lists_aligned() -> None:
    ep = _episode()
    ep.append([1, 2, 3], trained=False)
    ep.append([4, 5], trained=True, turn=0, logprobs=[-0.1, -0.2])
    ep.append([6], trained=False)
    ep.check()
    assert ep.token_ids == [1, 2, 3, 4, 5, 6]
    assert ep.loss_mask == [0, 0, 0, 1, 1, 0]
    assert ep.turn_index == [-1, -1, -1, 0, 0, -1]
    assert ep.rollout_logprobs == [0.0, 0.0, 0.0, -0.1, -0.2, 0.0]


def test_episode_append_rejects_misaligned_logprobs() -> None:
    with pytest.raises(ValueError, match="2 tokens but 1 log-probs"):
        _episode().append([1, 2], trained=True, turn=0, logprobs=[-0.1])


def test_episode_check_catches_disagreement() -> None:
    ep = _episode()
    ep.append([1, 2], trained=True, turn=0)
    ep.turn_index[1] = -1
    with pytest.raises(ValueError, match="loss_mask and turn_index disagree"):
        ep.check()
    ep.loss_mask.append(0)
    with pytest.raises(ValueError, match="episode lists disagree"):
        ep.check()


def test_rewards_and_groups() -> None:
    ep = _episode()
    ep.turns = [Turn(0, 0, 1, "a", reward=0.2), Turn(1, 2, 3, "b", reward=1.0)]
    assert ep.turn_rewards == [0.2, 1.0] and ep.total_reward == pytest.approx(1.2)
    group = EpisodeGroup("g", ep.task, [ep, _episode()])
    assert group.scores == pytest.approx([1.2, 0.0])


def test_wire_formats() -> None:
    call = [{"type": "function", "function": {"name": "f", "arguments": "{}"}}]
    assert Message("assistant", "x", tool_calls=call).to_dict() == {
        "role": "assistant",
        "content": "x",
        "tool_calls": call,
    }
    assert Message("tool", "r", name="f").to_dict() == {"role": "tool", "content": "r", "name": "f"}
    params = SamplingParams(max_new_tokens=8, temperature=0.0, stop_token_ids=[2], seed=3).to_dict()
    assert params == {
        "max_new_tokens": 8,
        "temperature": 0.0,
        "top_p": 1.0,
        "top_k": -1,
        "stop_token_ids": [2],
        "sampling_seed": 3,
    }


def test_types_module_does_not_import_torch() -> None:
    import subprocess
    import sys

    code = "import sys, userrl_megatron.types; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "False"
