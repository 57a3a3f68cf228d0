"""Settings of FunctionGym, config section `gyms.function`: each field with its comment (`userrl config show
--explain`), their ranges and choices (`RANGES`, `CHOICES`). `max_steps` is replaced by the rollout's max turns
(`gyms.config_for`)."""

from dataclasses import dataclass, field
from typing import ClassVar

from userrl_megatron.config.rules import COUNT, NON_NEGATIVE, Rule

FUNCTION_OPERATORS = ("+", "-", "*", "/", "**")


@dataclass
class FunctionGeneratorConfig:
    """The seeded generator of the `function-procedural` source."""

    seed: int = 0  # seed of the procedural stream; train and test draw disjoint tasks from it
    tasks_per_split: int = 256  # tasks in each split of the `function-procedural` source
    terms: int = 1  # distinct inputs (of a, b, c, d) the rule combines: 1 (easiest) to 4 (UserRL-like)
    operators: list[str] = field(default_factory=lambda: ["+", "-"])  # of + - * / and ** (squares a term)
    max_input: int = 9  # test-case inputs are drawn from 1..max_input
    reveal_test_case: bool = True  # state the test case in the first user message (no [search] needed)
    prompt_style: str = "userrl"  # "userrl" (UserRL's tool prompt) or "compact" (rule shown, 2 solved examples)
    balanced: bool = False  # task i's rule starts with input i mod 4, inputs distinct: a fixed position scores chance

    RANGES: ClassVar[dict[str, Rule]] = {
        "seed": NON_NEGATIVE,
        "tasks_per_split": COUNT,
        "terms": ("in 1..4 (inputs a, b, c, d)", lambda v: 1 <= v <= 4),
        "max_input": COUNT,
    }
    CHOICES: ClassVar[dict[str, tuple[str, ...]]] = {"prompt_style": ("userrl", "compact")}

    def problems(self, where: str) -> list[str]:
        """What is wrong with these settings together, each message naming its key under `where`."""
        problems = []
        unknown = [op for op in self.operators if op not in FUNCTION_OPERATORS]
        if unknown:
            problems.append(f"{where}.operators: unknown {unknown}; choose from {' '.join(FUNCTION_OPERATORS)}")
        if self.terms > 1 and not [op for op in self.operators if op != "**"]:
            problems.append(f"{where}.operators needs one of + - * / when terms > 1")
        if self.balanced and self.max_input < 4:
            problems.append(f"{where}.balanced needs four distinct inputs: max_input >= 4, got {self.max_input}")
        return problems


@dataclass
class FunctionGymConfig:
    """FunctionGym and its task generator."""

    max_steps: int = 20  # step limit (replaced by rollout.max_turns in training)
    generator: FunctionGeneratorConfig = field(default_factory=FunctionGeneratorConfig)  # `function-procedural`

    RANGES: ClassVar[dict[str, Rule]] = {"max_steps": COUNT}
