"""FunctionGym: guess a hidden arithmetic rule over four inputs by probing it, then answer the test case.

Deterministic (no LLM). Rewards: 1.0 for the correct answer (which ends the episode), 0 otherwise
(UserRL, arXiv 2509.19736; github.com/SalesforceAIResearch/UserRL, `gyms/FunctionGym`).
Probe numbers are read as floats, as in UserRL (`For numbers [1.0, 2.0, 3.0, 4.0], the result is 24.0.`), so a
probe costs a fixed number of float operations whatever the numbers: a result beyond the float range is an
overflow (the "cannot be calculated" feedback), never a 500-digit integer.
"""

import re
from typing import Any

from gyms.base import StepResult, register_gym, task_record
from gyms.function.rules import Number, Rule
from gyms.function.settings import FunctionGymConfig
from gyms.function.tasks import PROCEDURAL_SOURCE, function_record, function_smoke, function_tasks, procedural_tasks
from gyms.turn_gym import TurnGym
from userrl_megatron.types import Task

_NUMBER = re.compile(r"-?\d+\.?\d*")
TOLERANCE = 1e-6
# UserRL's feedback texts, byte for byte (the policy learns from them).
CANNOT_CALCULATE = (
    "Error parsing numbers or calculating result. This may happen like when division by zero occurs. "
    "Please try again with different number combinations."
)
WRONG_ANSWER = (
    "Your answer is wrong. Please continue to try and reason about the hidden function and make your answer "
    "attempt later."
)


class FunctionGym(TurnGym):
    name = "function"

    def __init__(self, task: Any, config: FunctionGymConfig | None = None, user_sim: Any = None) -> None:
        self.config = config or FunctionGymConfig()
        super().__init__(self.config.max_steps)
        self.record = task_record(task, lambda task_id: function_record(task_id, self.config.generator))
        self.rule = Rule(self.record["rule"])
        self.test_case: list[Number] = list(self.record["test_case"])
        self.expected = float(self.record["expected_result"])
        self.solved = False

    def start(self) -> None:
        self.solved = False

    def observation(self) -> str:
        return (
            "New function problem loaded. You can use [action] with four numbers to test the function, "
            "[search] for test case, or [answer] with your final guess."
        )

    async def act(self, tag: str | None, payload: str) -> StepResult:
        if tag == "action":
            return StepResult(self._probe(payload), 0.0)
        if tag == "search":
            if payload.lower() != "test":
                return StepResult("Search content should only be 'test' to get the test case.", 0.0)
            return StepResult(f"Test case: {self.test_case}", 0.0)
        if tag == "answer":
            return self._answer(payload)
        if tag == "finish":
            if self.solved:
                return StepResult("Episode finished. You answered correctly!", 0.0, done=True)
            expected = self.record["expected_result"]  # as the data holds it (UserRL prints it as stored)
            return StepResult(
                f"Episode finished without correct answer. The expected result for the test case was: {expected}",
                0.0,
                done=True,
            )
        return StepResult("Invalid action format. Please use [action], [search], [answer], or [finish].", 0.0)

    def _probe(self, payload: str) -> str:
        if not payload:
            return "Please provide four numbers after [action]."
        numbers = [float(n) for n in _NUMBER.findall(payload)]
        if len(numbers) != 4:
            return "Please provide exactly four numbers."
        if numbers == self.test_case:
            return "This is the test case and I cannot provide you with the calculation feedback."
        try:
            result = round(self.rule(numbers), 4)
        except (ArithmeticError, ValueError, TypeError):
            return CANNOT_CALCULATE
        return f"For numbers {numbers}, the result is {result}."

    def _answer(self, payload: str) -> StepResult:
        if not payload:
            return StepResult("Answer is empty. Please provide a numerical answer.", 0.0)
        value = _read_answer(payload)
        if value is None:
            return StepResult("Invalid numerical answer. Please provide a valid number.", 0.0)
        if abs(value - self.expected) <= TOLERANCE:
            self.solved = True
            return StepResult("Your answer is correct!", 1.0, done=True, info={"solved": True})
        return StepResult(WRONG_ANSWER, 0.0)


def _read_answer(payload: str) -> float | None:
    """The answered number: the payload itself, or the only number written in it ("The answer is 42.")."""
    try:
        return float(payload)
    except ValueError:
        numbers = _NUMBER.findall(payload)
        return float(numbers[0]) if len(numbers) == 1 else None


def function_procedural(split: str, settings: FunctionGymConfig) -> list[Task]:
    """The `function-procedural` source: rules from the seeded generator (`gyms.function.generator`)."""
    return procedural_tasks(split, settings.generator)


register_gym(
    "function",
    config_type=FunctionGymConfig,
    userrl_env="FunctionGym",
    tasks=function_tasks,
    smoke=function_smoke,
    procedural={PROCEDURAL_SOURCE: function_procedural},
)(FunctionGym)
