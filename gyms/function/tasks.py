"""FunctionGym tasks: UserRL's 538 rules (public data) and the procedural source `function-procedural` (no data)."""

import re
from pathlib import Path
from typing import Any

from gyms.data import check_split, data_dir, read_json, userrl_rows, userrl_task
from gyms.function.rules import generate_function
from gyms.function.settings import FunctionGeneratorConfig
from gyms.smoke import SmokeEpisode
from gyms.tools import INTERACT_TOOL
from userrl_megatron.types import Message, Task

FUNCTIONS_JSON = "userrl/gyms/FunctionGym/functiongym/data/functions.json"
PROCEDURAL_SOURCE = "function-procedural"
_GENERATED_ID = re.compile(r"^fgen-(train|test)-(-?\d+)-(\d+)$")

SYSTEM_PROMPT = """You are an agent interacting with an environment through the tool `interact_with_env`.

- Environment: FunctionGym hides a function that maps four numbers a, b, c, d to one result, using only \
addition, subtraction, multiplication, division and squaring. Discover the function by trying inputs, then \
apply it to the test case.

- Choices of the tool:
  * `search` with content `test`: reveals the test case (four numbers). Nothing else can be searched.
  * `action` with four integers separated by spaces: returns the function's result for those inputs.
  * `answer` with one number: your result for the test case. You may answer several times.

- Notes:
  * Think step by step inside <think> and </think> before each tool call.
  * The number of rounds is limited: change one input at a time and compare results to find the rule. The \
function may use the inputs in any order."""


def function_record(task_id: str, generator: FunctionGeneratorConfig, root: Path | None = None) -> dict[str, Any]:
    """The record of a task id: `fgen-<split>-<seed>-<index>` is generated, any other id read from the data."""
    match = _GENERATED_ID.match(task_id)
    if match:
        split, seed, index = match.group(1), int(match.group(2)), int(match.group(3))
        cfg = FunctionGeneratorConfig(**{**vars(generator), "seed": seed})
        return generate_function(cfg, split, index)
    for record in read_json(root or data_dir(), FUNCTIONS_JSON):
        if record["id"] == task_id:
            return record
    raise KeyError(f"FunctionGym has no task {task_id!r}")


def function_tasks(split: str, root: Path) -> list[Task]:
    """UserRL's function rows of `split` (460 train / 78 test) with their records."""
    check_split("function", split)
    records = {r["id"]: r for r in read_json(root, FUNCTIONS_JSON)}
    tasks = []
    for row in userrl_rows(root, "function_multiturn", split):
        task_id = row["reward_model"]["id"]
        tasks.append(userrl_task("function", row, task_id, records[task_id]))
    return tasks


def procedural_tasks(split: str, generator: FunctionGeneratorConfig) -> list[Task]:
    """`generator.tasks_per_split` generated tasks of `split`; train and test never share a task."""
    check_split(PROCEDURAL_SOURCE, split)
    records = (generate_function(generator, split, i) for i in range(generator.tasks_per_split))
    return [procedural_task(record, generator) for record in records]


COMPACT_SYSTEM_PROMPT = (
    "Compute the function for the test case. Reply with one line: [answer] followed by the number. "
    "If your answer is wrong, you may answer again."
)
COMPACT_EXAMPLES = 2


def compact_prompt(record: dict[str, Any], generator: FunctionGeneratorConfig) -> list[Message]:
    """The "compact" prompt for small models: the rule is shown, two solved examples come first."""
    examples = [generate_function(generator, "example", i) for i in range(COMPACT_EXAMPLES)]
    messages = [Message("system", COMPACT_SYSTEM_PROMPT)]
    for example in examples:
        messages += [
            Message("user", _compact_question(example)),
            Message("assistant", f"[answer] {_integral(example)}"),
        ]
    return [*messages, Message("user", _compact_question(record))]


def _compact_question(record: dict[str, Any]) -> str:
    return f"f(a, b, c, d) = {record['rule']}. Test case: {record['test_case']}."


def _integral(record: dict[str, Any]) -> str:
    value = float(record["expected_result"])
    return str(int(value)) if value.is_integer() else str(value)


def procedural_task(record: dict[str, Any], generator: FunctionGeneratorConfig) -> Task:
    """The Task of a generated record: UserRL's system prompt and a user message (with the test case if
    revealed), or the compact prompt (`generator.prompt_style: compact`, no tool schema: it states the format)."""
    if generator.prompt_style == "compact":
        task = Task(gym="function", task_id=record["id"], prompt=compact_prompt(record, generator))
        task.metadata = {"record": record, "ground_truth": str(record["expected_result"])}
        task.metadata |= {"data_source": PROCEDURAL_SOURCE, "reply_without_tool_call": "end"}
        return task
    user = "My mapping function is settled and ready. You may begin your guessing and trials now!"
    if generator.reveal_test_case:
        user += f"\nThe test case is {record['test_case']}: tell me the function's result for it."
    return Task(
        gym="function",
        task_id=record["id"],
        prompt=[Message("system", SYSTEM_PROMPT), Message("user", user)],
        tools=[INTERACT_TOOL],
        metadata={
            "record": record,
            "ground_truth": str(record["expected_result"]),
            "data_source": PROCEDURAL_SOURCE,
            "reply_without_tool_call": "end",
        },
    )


def function_smoke() -> list[SmokeEpisode]:
    """Scripted episodes: probe, search, wrong then right answer; bad actions; finish."""
    record = {"id": "smoke-1", "rule": "(c + b) ** 2 - a + d", "test_case": [9, 7, 4, 2], "expected_result": 114.0}
    return [
        SmokeEpisode(
            "probe, search, wrong then right answer",
            record,
            ["[action] 1 2 3 4", "[search] test", "[answer] 113", "[answer] 114"],
            [0.0, 0.0, 0.0, 1.0],
        ),
        SmokeEpisode(
            "bad actions, then finish",
            record,
            ["hello", "[action] 1 2", "[action] 9 7 4 2", "[search] rule", "[answer] many", "[finish]"],
            [0.0] * 6,
        ),
    ]
