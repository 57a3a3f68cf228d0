"""SFT data: rows checked with row numbers and reasons, tokenised exactly like rollouts, experts, dumps -> rows."""

import asyncio
import json
from pathlib import Path

import pytest

from gyms.tools import INTERACT_TOOL
from tests.support.chat_templates import interact_call, qwen3_chat, smollm2_chat
from tests.support.scripted import ScriptedEngine
from userrl_megatron.config.schema import GymsConfig, RolloutConfig
from userrl_megatron.data import load_tasks
from userrl_megatron.errors import UserError
from userrl_megatron.observability.dumps import write_episodes
from userrl_megatron.rollout.chat import ChatTemplate
from userrl_megatron.rollout.episode import EpisodeRunner, gym_factory
from userrl_megatron.sft.experts import episode_row, expert_actions, expert_rows
from userrl_megatron.sft.from_rollouts import select
from userrl_megatron.sft.rows import SFTRow, read_rows, write_rows
from userrl_megatron.sft.tokens import tokenize_row
from userrl_megatron.types import Episode, Message

IM_END = 151645


@pytest.fixture(scope="module")
def qwen3() -> ChatTemplate:
    return qwen3_chat()


@pytest.fixture(scope="module")
def smollm2() -> ChatTemplate:
    return smollm2_chat()


def rollout(chat: ChatTemplate, replies: list[str], max_turns: int = 8) -> Episode:
    """A real FunctionGym episode of the first procedural train task, the policy's replies scripted."""
    gyms = GymsConfig()
    task = load_tasks(["function-procedural"], "train", gyms)[0]  # rule "b", test case [4, 6, 1, 1]
    runner = EpisodeRunner(RolloutConfig(max_turns=max_turns), chat, gym_factory(gyms, max_turns))
    return asyncio.run(runner.run(task, ScriptedEngine(chat, replies), group_id="g0"))


def assistant_spans(mask: list[int]) -> list[tuple[int, int]]:
    spans, start = [], None
    for i, m in enumerate([*mask, 0]):
        if m and start is None:
            start = i
        if not m and start is not None:
            spans.append((start, i))
            start = None
    return spans


def test_sft_sample_equals_the_rollout_of_the_same_conversation(qwen3: ChatTemplate) -> None:
    replies = [
        interact_call("action", "1 2 3 4", reasoning="Probe first."),
        "<think>\nTwo calls.\n</think>\n\n"
        + interact_call("action", "2 3 4 5")
        + "\n"
        + interact_call("action", "1 1 1 1"),  # two calls in one turn: two tool messages
        interact_call("answer", "6", reasoning="It is b."),
    ]
    episode = rollout(qwen3, replies)
    assert episode.finish_reason == "done" and episode.total_reward == 1.0
    row = episode_row(episode, qwen3)
    assert [m.role for m in row.messages] == [
        "system",
        "user",
        "assistant",
        "tool",
        "assistant",
        "tool",
        "tool",
        "assistant",
    ]
    sample = tokenize_row(qwen3, row)
    assert sample.token_ids == episode.token_ids
    assert sample.loss_mask == episode.loss_mask
    # only assistant tokens are trained, every assistant turn, each ending with its <|im_end|>
    spans = assistant_spans(sample.loss_mask)
    assert spans == [(t.start, t.end) for t in episode.turns]
    for (start, end), reply in zip(spans, replies, strict=True):
        assert sample.token_ids[start:end] == [*qwen3.encode(reply), IM_END]


def test_openai_tool_calls_tokenise_like_the_text_a_policy_writes(qwen3: ChatTemplate) -> None:
    episode = rollout(qwen3, [interact_call("action", "1 2 3 4"), interact_call("answer", "6")])
    row = episode_row(episode, qwen3)
    for m in row.messages:  # the same conversation with structured calls instead of text
        if m.role == "assistant":
            call = json.loads(m.content.removeprefix("<tool_call>\n").removesuffix("\n</tool_call>"))
            arguments = json.dumps(call["arguments"])
            m.content, m.tool_calls = (
                "",
                [{"type": "function", "function": {"name": call["name"], "arguments": arguments}}],
            )
    sample = tokenize_row(qwen3, row)
    assert (sample.token_ids, sample.loss_mask) == (episode.token_ids, episode.loss_mask)


def test_tag_format_expert_rows_equal_their_rollouts(smollm2: ChatTemplate) -> None:
    gyms, cfg = GymsConfig(), RolloutConfig()
    rows = expert_rows("function-procedural", "train", gyms, cfg, smollm2, limit=4)
    assert len(rows) == 4  # every expert episode is solved
    tasks = load_tasks(["function-procedural"], "train", gyms)[:4]
    for row, task in zip(rows, tasks, strict=True):
        assert row.source == f"expert:function-procedural:{task.task_id}"
        actions = expert_actions(task)
        assert actions[0] == "[action] 1 2 3 4" and actions[-1].startswith("[answer] ")
        episode = rollout(smollm2, actions) if task is tasks[0] else None
        sample = tokenize_row(smollm2, row)
        assert sum(1 for _ in assistant_spans(sample.loss_mask)) == len(actions)
        if episode is not None:
            assert (sample.token_ids, sample.loss_mask) == (episode.token_ids, episode.loss_mask)
            assert [m.role for m in row.messages] == ["system", "user", "assistant", "user", "assistant"]
            assert row.messages[3].content == "For numbers [1.0, 2.0, 3.0, 4.0], the result is 2.0.\nReward: 0.0"
            assert row.messages[4].content == "[answer] 6"


def test_rows_round_trip_and_bad_rows_are_rejected_with_row_and_reason(tmp_path: Path, qwen3: ChatTemplate) -> None:
    good = SFTRow([Message("user", "hi"), Message("assistant", "hello")], [INTERACT_TOOL])
    path = write_rows(tmp_path / "rows.jsonl", [good])
    lines = [
        path.read_text().strip(),
        "{not json",
        json.dumps([1, 2]),
        json.dumps({"text": "x"}),
        json.dumps({"messages": []}),
        json.dumps({"messages": [{"role": "user", "content": "hi"}]}),
        json.dumps({"messages": [{"role": "assistant", "content": "hi"}]}),
        json.dumps({"messages": [{"role": "user", "content": "a"}, {"role": "bot", "content": "b"}]}),
        json.dumps({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": 3}]}),
        json.dumps({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": ""}]}),
        json.dumps(
            {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}], "tools": [1]}
        ),
        json.dumps(
            {
                "messages": [
                    {"role": "user", "content": "a"},
                    {"role": "assistant", "content": "b"},
                    {"role": "assistant", "content": "c"},
                ]
            }
        ),
        json.dumps({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "tool_calls": [{"x": 1}]}]}),
    ]
    path.write_text("\n".join(lines) + "\n\n")
    rows, rejected = read_rows(path)
    assert [r.messages for r in rows] == [good.messages] and rows[0].tools == [INTERACT_TOOL]
    assert rows[0].source == f"{path}:1"
    assert [str(r) for r in rejected] == [
        f"{path}:2: not valid JSON (Expecting property name enclosed in double quotes: line 1 column 2 (char 1))",
        f"{path}:3: a row must be a JSON object, got list",
        f'{path}:4: no "messages" (OpenAI style) or "conversations" (ShareGPT style)',
        f"{path}:5: messages is empty",
        f"{path}:6: no assistant message: nothing to train on",
        f"{path}:7: the messages before the first assistant message must be system or user messages (a prompt)",
        f"{path}:8: messages[1].role must be one of system, user, assistant, tool, got 'bot'",
        f"{path}:9: messages[1].content must be a string, got int",
        f"{path}:10: messages[1]: an assistant message with neither content nor tool_calls",
        f"{path}:11: tools[0] must be an object (an OpenAI function schema)",
        f"{path}:12: messages[1] and [2] are both assistant messages (no reply between the turns)",
        f'{path}:13: messages[1].tool_calls[0] needs "function": {{"name": ..., "arguments": ...}}',
    ]


def test_sharegpt_rows_and_parquet(tmp_path: Path, qwen3: ChatTemplate) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    call = {"name": "interact_with_env", "arguments": {"choice": "answer", "content": "6"}}
    sharegpt = {
        "system": "S",
        "tools": json.dumps([INTERACT_TOOL["function"]]),
        "conversations": [
            {"from": "human", "value": "Go."},
            {"from": "function_call", "value": json.dumps(call)},
            {"from": "observation", "value": "Correct."},
            {"from": "gpt", "value": "Done."},
        ],
    }
    openai = {"messages": json.dumps([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}])}
    path = tmp_path / "rows.parquet"
    pq.write_table(pa.Table.from_pylist([openai, {"messages": "[1"}]), path)
    rows, rejected = read_rows(path)
    assert [m.content for m in rows[0].messages] == ["a", "b"]
    assert [str(r) for r in rejected] == [
        f"{path}:2: messages is a string but not JSON (Expecting ',' delimiter: line 1 column 3 (char 2))"
    ]
    jsonl = tmp_path / "sharegpt.jsonl"
    jsonl.write_text(json.dumps(sharegpt) + "\n")
    (row,), rejected = read_rows(jsonl)
    assert not rejected and row.tools == [INTERACT_TOOL]
    assert [m.role for m in row.messages] == ["system", "user", "assistant", "tool", "assistant"]
    assert qwen3.assistant_text(row.messages[2], row.tools) == interact_call("answer", "6")
    with pytest.raises(UserError, match=r"expected a \.jsonl or \.parquet file"):
        read_rows(tmp_path / "rows.csv")


def test_rows_from_rollout_dumps(tmp_path: Path, qwen3: ChatTemplate) -> None:
    solved = rollout(qwen3, [interact_call("action", "1 2 3 4"), interact_call("answer", "6")])
    slow = rollout(
        qwen3, [interact_call("action", "1 2 3 4"), interact_call("answer", "5"), interact_call("answer", "6")]
    )
    failed = rollout(qwen3, [interact_call("answer", "5")], max_turns=1)
    other = rollout(qwen3, [interact_call("answer", "6")])
    other.group_id = "g1"
    write_episodes(tmp_path / "rollouts" / "step_1.jsonl", [solved, slow, failed, other], step=1)
    old = tmp_path / "rollouts" / "step_2.jsonl"
    write_episodes(old, [solved], step=2)
    record = json.loads(old.read_text())
    del record["messages"]  # a dump written before records carried the conversation
    old.write_text(json.dumps(record) + "\n")

    everything = select(tmp_path, qwen3, min_reward=1.0)
    assert (everything.episodes, everything.below, everything.not_best) == (5, 1, 0)
    assert len(everything.rows) == 3
    assert [str(r) for r in everything.rejected] == [
        f"{old}:1: the record has no messages (dumps written before they carried the conversation)"
    ]
    assert tokenize_row(qwen3, everything.rows[0]).token_ids == solved.token_ids

    best = select(tmp_path, qwen3, min_reward=1.0, best_per_group=True)
    assert (best.episodes, best.below, best.not_best, len(best.rows)) == (5, 1, 1, 2)
    assert [r.source for r in best.rows] == [
        f"{tmp_path}/rollouts/step_1.jsonl:1",
        f"{tmp_path}/rollouts/step_1.jsonl:4",
    ]
    with pytest.raises(UserError, match=r"no rollouts/step_N\.jsonl dumps"):
        select(tmp_path / "rollouts", qwen3)


def test_sft_command_with_no_valid_row_names_the_rejections(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    from userrl_megatron.cli import main

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": []}\n[1]\n')
    code = main(
        ["sft", f"run.output_dir={tmp_path}", "run.name=sft", f"sft.train_files=[{bad}]", "logging.backends=[]"]
    )
    assert code == 2
    err = capsys.readouterr().err
    assert f"userrl: error: sft.train_files ['{bad}']: no row left to train on (2 rejected)" in err
    rejected = (tmp_path / "sft" / "rejected_train_rows.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in rejected] == [
        {"row": f"{bad}:1", "reason": "messages is empty"},
        {"row": f"{bad}:2", "reason": "a row must be a JSON object, got list"},
    ]
    assert "sft train data: 2 row(s) rejected" in caplog.text  # on the console and in run.log outside pytest
    assert f"rejected {bad}:1: messages is empty" in caplog.text


def test_rows_from_an_eval_episodes_file(tmp_path: Path, qwen3: ChatTemplate) -> None:
    from userrl_megatron.eval.results import group_records, write_episodes_jsonl
    from userrl_megatron.types import EpisodeGroup

    solved = rollout(qwen3, [interact_call("action", "1 2 3 4"), interact_call("answer", "6")])
    wrong = rollout(qwen3, [interact_call("answer", "5")], max_turns=1)
    group = EpisodeGroup("g0", solved.task, [wrong, solved])
    path = tmp_path / "episodes.jsonl"
    write_episodes_jsonl(path, group_records([group]))  # what `userrl eval` writes
    picked = select(path, qwen3, min_reward=1.0, best_per_group=True)
    assert (picked.episodes, picked.below, picked.not_best, picked.rejected) == (2, 1, 0, [])
    assert [r.source for r in picked.rows] == [f"{path}:2"]
    sample = tokenize_row(qwen3, picked.rows[0])
    assert (sample.token_ids, sample.loss_mask) == (solved.token_ids, solved.loss_mask)
