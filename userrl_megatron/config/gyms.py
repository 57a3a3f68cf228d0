"""Typed settings of each built-in gym, one dataclass per gym (fields of `GymsConfig`, config section `gyms`), and
of the user simulator they share (`UserSimConfig`, config section `user_sim`). The gyms read them; a gym added as
one folder brings its own dataclass instead (`gyms/README.md`, "Adding a gym"). A settings dataclass checks its
fields together in `problems(where) -> list[str]` (`settings_problems` finds them, nested ones too).

Defaults are UserRL's training settings (its env_manager overrides, spec §3), with the UserRL bugs fixed (see
gyms/README.md). `max_steps` is always replaced by the rollout's max turns: a gym's config comes from
`gyms.config_for(name, gyms_cfg, max_steps)`. Every field carries a one-line comment (`userrl config show --explain`).
"""

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar

from userrl_megatron.config.rules import (
    COUNT,
    NON_NEGATIVE,
    POSITIVE,
    PROBABILITY,
    YAML_ON_OFF,
    Rule,
    choice_problem,
    range_problem,
)

FUNCTION_OPERATORS = ("+", "-", "*", "/", "**")


def settings_problems(settings: Any, where: str) -> list[str]:
    """What a settings dataclass finds wrong with itself, each message naming its key under `where`: its `RANGES`
    (field -> `config.rules.Rule`), its `CHOICES` (field -> allowed strings), its `problems(where)` (fields checked
    together), and the same of every dataclass among its fields, recursively."""
    if not dataclasses.is_dataclass(settings) or isinstance(settings, type):
        return []
    ranges: dict[str, Rule] = getattr(settings, "RANGES", {})
    choices: dict[str, tuple[str, ...]] = getattr(settings, "CHOICES", {})
    found = [range_problem(f"{where}.{name}", getattr(settings, name), rule) for name, rule in ranges.items()]
    found += [choice_problem(f"{where}.{name}", getattr(settings, name), allowed) for name, allowed in choices.items()]
    check = getattr(settings, "problems", None)
    problems = [problem for problem in found if problem] + (list(check(where)) if callable(check) else [])
    for f in dataclasses.fields(settings):
        problems += settings_problems(getattr(settings, f.name), f"{where}.{f.name}")
    return problems


@dataclass
class FunctionGeneratorConfig:
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
    max_steps: int = 20  # step limit (replaced by rollout.max_turns in training)
    generator: FunctionGeneratorConfig = field(default_factory=FunctionGeneratorConfig)  # `function-procedural`

    RANGES: ClassVar[dict[str, Rule]] = {"max_steps": COUNT}


@dataclass
class IntentionGymConfig:
    max_steps: int = 20  # step limit (replaced by rollout.max_turns in training)
    multi_detail_penalty: float = 0.2  # reward cut per extra detail covered by one question
    history_turns: int = 3  # past exchanges shown to the user simulator and the coverage judge

    RANGES: ClassVar[dict[str, Rule]] = {
        "max_steps": COUNT,
        "multi_detail_penalty": PROBABILITY,
        "history_turns": NON_NEGATIVE,
    }


@dataclass
class PersuadeGymConfig:
    max_steps: int = 20  # step limit (replaced by rollout.max_turns in training)
    reward_baseline: str = "best"  # stance moves are paid from "best" stance so far (fix) or "previous" (UserRL)

    RANGES: ClassVar[dict[str, Rule]] = {"max_steps": COUNT}
    CHOICES: ClassVar[dict[str, tuple[str, ...]]] = {"reward_baseline": ("best", "previous")}


@dataclass
class SearchGymConfig:
    max_steps: int = 20  # step limit (replaced by rollout.max_turns in training)
    max_search_steps: int = 5  # searches allowed per episode
    max_search_results: int = 5  # results shown per search
    judge: str = "llm"  # answers failing the exact match go to the LLM judge ("llm") or are wrong ("exact")
    judge_max_tokens: int = 512  # completion limit of the answer judge (UserRL's SearchGym value)
    backend: str = "offline"  # "offline" (BM25 over corpus_path) or "web" (HTTP search API)
    corpus_path: str = ""  # offline corpus: a .jsonl file of {title, text} or a folder of .txt/.md files
    web_url: str = "https://google.serper.dev/search"  # web backend endpoint (Serper-compatible JSON API)
    web_api_key_env: str = "SERPER_API_KEY"  # environment variable holding the web search API key
    web_timeout_s: float = 10.0  # timeout of one web search request
    web_retries: int = 2  # retries of a failed web search request

    RANGES: ClassVar[dict[str, Rule]] = {
        "max_steps": COUNT,
        "max_search_steps": COUNT,
        "max_search_results": COUNT,
        "judge_max_tokens": COUNT,
        "web_timeout_s": POSITIVE,
        "web_retries": NON_NEGATIVE,
    }
    CHOICES: ClassVar[dict[str, tuple[str, ...]]] = {"judge": ("llm", "exact"), "backend": ("offline", "web")}


@dataclass
class TelepathyGymConfig:
    max_steps: int = 20  # step limit (replaced by rollout.max_turns in training)

    RANGES: ClassVar[dict[str, Rule]] = {"max_steps": COUNT}


@dataclass
class TravelGymConfig:
    max_steps: int = 20  # step limit (replaced by rollout.max_turns in training)
    search_correct_reward: float = 0.0  # reward of a correct first search of an aspect (UserRL eval: 0.2)
    preference_correct_reward: float = 0.8  # reward of a question that elicits a hidden preference (eval: 0.6)
    choice_best_reward: float = 1.0  # reward of recommending the best (cheapest correct) option
    choice_correct_reward: float = 0.8  # reward of recommending a correct but not the best option
    search_failure_interval: int = 5  # every k-th search fails on purpose (0 disables)
    elicitation_interval: int = 3  # after k off-preference utterances the user volunteers a preference
    one_choice_per_aspect: bool = True  # a second recommendation for an aspect is refused

    RANGES: ClassVar[dict[str, Rule]] = {
        "max_steps": COUNT,
        "search_correct_reward": PROBABILITY,
        "preference_correct_reward": PROBABILITY,
        "choice_best_reward": PROBABILITY,
        "choice_correct_reward": PROBABILITY,
        "search_failure_interval": NON_NEGATIVE,
        "elicitation_interval": COUNT,
    }


@dataclass
class TurtleGymConfig:
    max_steps: int = 20  # step limit (replaced by rollout.max_turns in training)
    success_threshold: float = 1.0  # rubric score that solves the story and ends the episode (UserRL default 0.9)

    RANGES: ClassVar[dict[str, Rule]] = {"max_steps": COUNT, "success_threshold": PROBABILITY}


@dataclass
class TauGymConfig:
    max_steps: int = 30  # tool calls + messages to the user per episode (replaced by rollout.max_turns in training)
    data_dir: str = ""  # folder holding taubench/ and userrl/; empty = where the task was loaded from
    customer_temperature: float | None = None  # sampling temperature of the customer; None: not sent (tau-bench)
    customer_max_tokens: int | None = None  # completion limit of the customer; None: not sent (tau-bench)

    RANGES: ClassVar[dict[str, Rule]] = {"max_steps": COUNT}


@dataclass
class EchoGymConfig:
    max_steps: int = 20  # step limit (replaced by rollout.max_turns in training)
    turns: int = 3  # turns per episode (each asks for one letter)
    alphabet: str = "ab"  # letters the user may ask for
    same_letter: bool = True  # ask for the same letter every turn (False: a fresh letter each turn)
    seed: int = 0  # seed of the `echo-procedural` task stream
    tasks_per_split: int = 64  # tasks in each split of `echo-procedural`
    reply_delay_median_s: float = 0.0  # the user's reply delay per step: log-normal with this median (0 = none)
    reply_delay_p99_s: float = 0.0  # ... and this 99th percentile (heavy tail: a slow simulated user; >= median)

    RANGES: ClassVar[dict[str, Rule]] = {
        "max_steps": COUNT,
        "turns": COUNT,
        "seed": NON_NEGATIVE,
        "tasks_per_split": COUNT,
        "reply_delay_median_s": NON_NEGATIVE,
        "reply_delay_p99_s": NON_NEGATIVE,
    }


@dataclass
class UserSimEnginesConfig:
    model: str = ""  # model the run serves as the user simulator ("": none, user_sim.base_url is used as it is)
    num_engines: int = 1  # frozen simulator engines (several: behind sglang-router)
    engine_tp: int = 1  # GPUs per simulator engine (tensor parallel)
    backend: str = ""  # "embedded" or "sglang"; "" = rollout.backend
    dtype: str = ""  # weight dtype of the simulator engines; "" = model.dtype
    mem_fraction_static: float = 0.0  # SGLang's share of each simulator GPU (weights + KV); 0 = rollout.sglang's
    context_length: int = 0  # longest prompt + reply a simulator engine serves; 0 = the simulator model's own
    placement: str = "own"  # "own": GPUs of their own; "policy_engines": on the policy engines' GPUs (docs/rollout.md)

    @property
    def shares_policy_engines(self) -> bool:
        """Served on the policy engines' GPUs (`placement: policy_engines`) rather than on GPUs of their own."""
        return bool(self.model) and self.placement == "policy_engines"


@dataclass
class UserSimConfig:
    base_url: str = "http://127.0.0.1:8000/v1"  # OpenAI-compatible endpoint of the user simulator / judge LLM
    model: str = "gpt-4o"  # model name sent to the endpoint
    api_key_env: str = "OPENAI_API_KEY"  # environment variable holding the API key ("none": a server without auth)
    temperature: float = 0.0  # sampling temperature of simulator calls
    max_tokens: int = 2048  # completion limit of one simulator call
    timeout_s: float = 30.0  # per-call timeout
    max_retries: int = 4  # retries after a timeout, 429 or 5xx before the call counts as failed
    backoff_s: float = 1.0  # first retry delay; doubles each retry, with jitter
    backoff_max_s: float = 30.0  # longest retry delay
    max_concurrency: int = 64  # simulator calls in flight at once
    cache_dir: str = ""  # on-disk response cache keyed by the request; empty disables it
    disable_thinking: bool = False  # send chat_template_kwargs.enable_thinking=false (Qwen3 on vLLM/SGLang)
    http_backend: str = "aiohttp"  # HTTP transport of the openai client: "aiohttp" (fast when busy) or "httpx"
    max_reply_chars: int = 100_000  # longer replies (thinking included) are a failed call, not episode text
    structured: str = "auto"  # ask for JSON-schema replies: on, off, auto (on until the endpoint first refuses them)
    engines: UserSimEnginesConfig = field(default_factory=UserSimEnginesConfig)  # simulator engines the run starts

    @property
    def structured_mode(self) -> str:
        """`structured` as auto/on/off: YAML reads a bare on/off as a boolean, which arrives here as "True"/"False"."""
        return YAML_ON_OFF.get(self.structured, self.structured)
