"""The step bookkeeping every gym shares: step count, the step limit, the end of an episode, simulator failures.

A gym subclasses TurnGym and implements `act(tag, payload)` for one parsed action. TurnGym counts the step,
marks truncation at `max_steps`, refuses steps after the end (with feedback, never an exception), and turns a
UserSimError escaping `act` into the gym's fallback feedback with reward 0 and `StepResult.user_sim_error`, so the
trainer can drop or mask the episode.
"""

from typing import Any

from gyms.base import StepResult, parse_action
from gyms.reply_schema import ReplySchema
from gyms.user_sim import UserSimError

EPISODE_OVER = "The episode has already ended; no further actions are accepted."


class TurnGym:
    """Base of the built-in gyms; subclasses set `name` and implement `act`."""

    name = ""
    needs_user_sim = False  # steps call the user simulator: construction without one is an error
    # Feedback shown when the user simulator failed for good (the gym's state is left as it was).
    fallback_feedback = "Sorry, I cannot respond right now. Please try again."

    def __init__(self, max_steps: int, user_sim: Any = None) -> None:
        if max_steps < 1:
            raise ValueError(f"max_steps must be >= 1, got {max_steps}")
        if self.needs_user_sim and user_sim is None:
            raise ValueError(
                f"gym {self.name} needs a user simulator: make_gym(..., user_sim=UserSimulator(cfg.user_sim))"
            )
        self.max_steps = max_steps
        self.user_sim = user_sim
        self.steps = 0
        self.ended = False

    async def reset(self) -> str:
        """Start (or restart) the episode; returns the initial observation."""
        self.steps = 0
        self.ended = False
        self.start()
        return self.observation()

    async def step(self, action: str) -> StepResult:
        """Apply one action string; never raises on bad actions or simulator failures."""
        if self.ended:
            return StepResult(EPISODE_OVER, 0.0, done=True, info={"error": "episode_over"})
        self.steps += 1
        tag, payload = parse_action(action)
        try:
            result = await self.act(tag, payload)
        except UserSimError as e:
            result = StepResult(self.failure_feedback(tag, payload), 0.0, user_sim_error=str(e))
        if not result.done and self.steps >= self.max_steps:
            result.truncated = True
        self.ended = result.ended
        result.info["step"] = self.steps
        return result

    async def close(self) -> None:
        """Nothing to release by default; idempotent."""

    def failure_feedback(self, tag: str | None, payload: str) -> str:
        """The feedback of a step whose simulator call failed for good (default: `fallback_feedback`)."""
        return self.fallback_feedback

    def start(self) -> None:
        """Reset the gym's own episode state (called by reset)."""

    def observation(self) -> str:
        """The initial observation text (not shown to the policy in training: it sees the task prompt)."""
        return ""

    async def act(self, tag: str | None, payload: str) -> StepResult:
        """Handle one action: `tag` is action/answer/search/finish or None (untagged), `payload` the rest."""
        raise NotImplementedError

    async def ask(
        self, system: str, user: str, *keys: str, reply: ReplySchema | None = None, max_tokens: int | None = None
    ) -> dict[str, Any]:
        """One simulator call answered with a JSON object holding `keys` (or `reply.needs`); UserSimError otherwise.

        `reply` states the object (`gyms/reply_schema.py`): the client asks for it as a structured reply
        (`user_sim.structured`). `max_tokens` overrides the simulator's completion limit (`user_sim.max_tokens`).
        """
        if reply is not None and keys:
            raise ValueError("give the keys a reply needs in its ReplySchema, not as well as it")
        needed = reply.needs if reply is not None else keys
        messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
        extra = {"schema": reply} if reply is not None else {}  # stand-ins without schemas keep working
        answer = await self.user_sim.chat(messages, max_tokens=max_tokens, json=True, **extra)
        data = answer.data or {}
        missing = [k for k in needed if k not in data]
        if missing:
            note = getattr(self.user_sim, "unusable_reply", None)  # stand-ins in tests may not count
            if note is not None:
                note()
            raise UserSimError(f"simulator reply lacks {', '.join(missing)}: {answer.text[:200]!r}", "bad_json", 1)
        return data
