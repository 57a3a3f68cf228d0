"""Values that cross module and process boundaries. Plain dataclasses: no torch import here.

An Episode is token-exact: `token_ids` are the prompt followed by every generated and every environment
token in order; `loss_mask` marks the tokens the policy generated (the only ones trained); `turn_index`
says which assistant turn each trained token belongs to (-1 elsewhere).
"""

from dataclasses import dataclass, field
from typing import Any, Literal

Role = Literal["system", "user", "assistant", "tool"]

FinishReason = Literal[
    "done",  # the gym terminated the episode
    "truncated",  # the gym's step limit was reached
    "max_turns",  # rollout.max_turns assistant turns were generated
    "max_tokens",  # the episode's token budget ran out
    "no_tool_call",  # the reply contained no tool call / action
    "bad_tool_call",  # the reply's tool call could not be parsed
    "gym_error",  # the gym raised
    "user_sim_error",  # the user simulator failed after its retries
    "engine_error",  # the rollout engine failed after its retries
]


@dataclass
class Message:
    """One chat message; `tool_calls` follows the OpenAI schema for assistant tool calls, and a tool result names
    the call it answers in `tool_call_id` (OpenAI refuses one without)."""

    role: Role
    content: str
    tool_calls: list[dict[str, Any]] | None = None
    name: str | None = None
    tool_call_id: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """The message as an OpenAI / chat-template dictionary."""
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            out["tool_calls"] = self.tool_calls
        if self.name is not None:
            out["name"] = self.name
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


@dataclass
class Task:
    """One dataset row: which gym, which task inside it, and the prompt the policy starts from."""

    gym: str
    task_id: str
    prompt: list[Message]
    tools: list[dict[str, Any]] = field(default_factory=list)
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass
class SamplingParams:
    """Sampling settings of one generate call (SGLang `sampling_params` names)."""

    max_new_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None

    def to_dict(self) -> dict[str, Any]:
        """The SGLang `sampling_params` payload."""
        out: dict[str, Any] = {
            "max_new_tokens": self.max_new_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
        }
        if self.stop_token_ids:
            out["stop_token_ids"] = list(self.stop_token_ids)
        if self.seed is not None:
            out["sampling_seed"] = self.seed
        return out


@dataclass
class Turn:
    """One assistant turn: the generated span of the episode and what the gym made of it."""

    index: int
    start: int  # first generated token (index into Episode.token_ids)
    end: int  # one past the last generated token
    text: str  # decoded generated text (for logs; never re-tokenized for training)
    action: str | None = None  # gym action parsed from the reply, e.g. "[answer] 42"
    feedback: str = ""  # gym feedback shown to the policy
    reward: float = 0.0
    info: dict[str, Any] = field(default_factory=dict)
    weight_version: int = 0  # engine weight version that generated this turn (the trainer's step number)


@dataclass
class Episode:
    """One multi-turn trajectory, token-exact, with what the algorithm and the logs need."""

    task: Task
    group_id: str
    token_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)  # 1 on generated tokens, 0 elsewhere
    turn_index: list[int] = field(default_factory=list)  # assistant turn of each trained token, -1 elsewhere
    rollout_logprobs: list[float] = field(default_factory=list)  # engine log-prob of each token (0.0 if not generated)
    prompt_length: int = 0
    turns: list[Turn] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    weight_version: int = 0  # oldest engine weight version among its turns (Turn.weight_version)
    metadata: dict[str, Any] = field(default_factory=dict)
    # MoE routing replay: int32 [n, layers x top_k] chunks, in order, the experts the engine routed positions
    # 0 … routed_length - 1 to (every position it ran, prompt and replies included; empty without replay)
    routed_experts: list[Any] = field(default_factory=list)

    @property
    def routed_length(self) -> int:
        """Positions from the start whose engine routing is recorded."""
        return sum(len(chunk) for chunk in self.routed_experts)

    @property
    def turn_rewards(self) -> list[float]:
        """Reward of each assistant turn, in order (the algorithm's per-turn input)."""
        return [t.reward for t in self.turns]

    @property
    def total_reward(self) -> float:
        """The episode return: the sum of turn rewards."""
        return sum(self.turn_rewards)

    def append(self, ids: list[int], *, trained: bool, turn: int = -1, logprobs: list[float] | None = None) -> None:
        """Append tokens, keeping the per-token lists aligned."""
        if logprobs is not None and len(logprobs) != len(ids):
            raise ValueError(f"{len(ids)} tokens but {len(logprobs)} log-probs")
        self.token_ids.extend(ids)
        self.loss_mask.extend([1 if trained else 0] * len(ids))
        self.turn_index.extend([turn if trained else -1] * len(ids))
        self.rollout_logprobs.extend(logprobs if logprobs is not None else [0.0] * len(ids))

    def check(self) -> None:
        """Raise if the per-token lists disagree in length or the mask and turn indices disagree."""
        n = len(self.token_ids)
        lengths = (len(self.loss_mask), len(self.turn_index), len(self.rollout_logprobs))
        if any(length != n for length in lengths):
            raise ValueError(f"episode lists disagree: {n} tokens, mask/turn/logprob lengths {lengths}")
        if any((m == 1) != (t >= 0) for m, t in zip(self.loss_mask, self.turn_index, strict=True)):
            raise ValueError("loss_mask and turn_index disagree")


@dataclass
class EpisodeGroup:
    """The episodes of one task: the unit GRPO normalises over."""

    group_id: str
    task: Task
    episodes: list[Episode] = field(default_factory=list)

    @property
    def scores(self) -> list[float]:
        """Return of each episode."""
        return [e.total_reward for e in self.episodes]

    @property
    def has_signal(self) -> bool:
        """Its episodes scored differently: equal scores give zero GRPO advantages (no signal, only cost)."""
        return len(set(self.scores)) > 1


@dataclass
class TrainBatch:
    """Episodes flattened for the actor: lists of per-token lists (right-padded into tensors by the actor)."""

    token_ids: list[list[int]]
    loss_mask: list[list[int]]
    advantages: list[list[float]]
    old_logprobs: list[list[float]] | None = None
    ref_logprobs: list[list[float]] | None = None
    rollout_logprobs: list[list[float]] | None = None
    turn_versions: list[list[int]] | None = None  # weight version of each assistant turn, per episode
    # MoE routing replay: per episode int32 [n, layers x top_k], the engine's experts for positions 0 … n - 1
    routed_experts: list[Any] | None = None

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_trained_tokens(self) -> int:
        """Tokens that carry loss."""
        return sum(sum(m) for m in self.loss_mask)
