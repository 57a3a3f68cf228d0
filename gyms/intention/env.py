"""IntentionGym: each question is answered by the simulated user and credited for the details it covers (§3.2).

Two simulator calls per question, made concurrently: the user's answer (the feedback) and the coverage judge.
Reward of a question covering details C of the remaining ones: {3: 1.0, 2: 0.7, 1: 0.4}[max importance in C],
minus `multi_detail_penalty` per extra detail (floored at 0); 0 when C is empty. The episode return can
exceed 1 (one reward per detail). Covering every detail ends the episode.
"""

import asyncio
from typing import Any

from gyms.base import StepResult, register_gym, task_record
from gyms.intention import prompts, replies
from gyms.intention.settings import IntentionGymConfig
from gyms.intention.tasks import intention_record, intention_smoke, intention_tasks
from gyms.turn_gym import TurnGym

IMPORTANCE_REWARD = {3: 1.0, 2: 0.7, 1: 0.4}


class IntentionGym(TurnGym):
    name = "intention"
    needs_user_sim = True
    fallback_feedback = "Sorry, I'm not sure how to answer that right now. Could you ask again?"

    def __init__(self, task: Any, config: IntentionGymConfig | None = None, user_sim: Any = None) -> None:
        self.config = config or IntentionGymConfig()
        super().__init__(self.config.max_steps, user_sim)
        self.record = task_record(task, intention_record)
        self.start()

    def start(self) -> None:
        self.remaining: list[dict[str, Any]] = list(self.record["missing_details"])
        self.covered: list[dict[str, Any]] = []
        self.history: list[tuple[str, str]] = []

    def observation(self) -> str:
        return (  # UserRL's text, byte for byte
            f"Welcome to IntentionGym! Here's a vague task that needs clarification: '{self.record['task']}'. "
            "Ask me questions to understand what exactly I need help with!"
        )

    async def act(self, tag: str | None, payload: str) -> StepResult:
        total = len(self.record["missing_details"])
        if tag == "finish":
            return StepResult(f"Session ended. You covered {len(self.covered)}/{total} missing details.", 0.0, True)
        if not payload:
            return StepResult("Please ask me a clarifying question.", 0.0)
        recent = self.history[-self.config.history_turns :] if self.config.history_turns > 0 else []
        history = "\n".join(f"Assistant: {q}\nUser: {a}" for q, a in recent) or "(none yet)"
        fields = {"category": self.record["category"], "task": self.record["task"], "history": history}
        answer: dict[str, Any] | BaseException
        judgment: dict[str, Any] | BaseException
        answer, judgment = await asyncio.gather(
            self.ask(
                prompts.USER_SYSTEM,
                prompts.USER_USER.format(**fields, details=_hidden(self.record["missing_details"]), question=payload),
                reply=replies.USER,
            ),
            self.ask(
                prompts.JUDGE_SYSTEM,
                prompts.JUDGE_USER.format(**fields, details=_numbered(self.remaining), question=payload),
                reply=replies.judge(len(self.remaining)),
            ),
            return_exceptions=True,  # both calls finish before the step returns, failed or not
        )
        if isinstance(answer, BaseException):
            raise answer
        if isinstance(judgment, BaseException):
            raise judgment
        newly = self._covered_by(judgment)
        response = str(answer["response"])  # as UserRL shows it: not stripped
        self.history.append((payload, response))
        self.remaining = [d for d in self.remaining if not any(d is n for n in newly)]
        self.covered += newly
        reward = 0.0
        if newly:
            top = max(int(d["importance"]) for d in newly)
            reward = round(
                max(0.0, IMPORTANCE_REWARD.get(top, 0.4) - self.config.multi_detail_penalty * (len(newly) - 1)), 6
            )
        info = {"covered": [d["description"] for d in newly], "remaining": len(self.remaining)}
        return StepResult(response, reward, done=not self.remaining, info=info)

    def _covered_by(self, judgment: dict[str, Any]) -> list[dict[str, Any]]:
        """Remaining details the judge says the question covers, read as UserRL reads them.

        A falsy `is_task_related` (false, 0, "", null) covers nothing; any other value, the string "false"
        included, lets the numbers count. Numbers are ints or digit strings (`"2"`; `" 2"`, `2.0`, `true`, `-1`
        are dropped); one that is digits but no integer (`"²"`) voids the whole reply, as its failed `int()` did
        in UserRL. Numbers outside the list are ignored. A detail named twice counts once (deviation: UserRL
        counted it twice, paying the multi-detail penalty for it and listing it twice as covered).
        """
        if not judgment.get("is_task_related", True):
            return []
        numbers = judgment["covered_detail_numbers"]
        picked: list[dict[str, Any]] = []
        for n in numbers if isinstance(numbers, list) else []:
            if not (isinstance(n, int | str) and not isinstance(n, bool) and str(n).isdigit()):
                continue
            try:
                index = int(n)
            except ValueError:
                return []
            if 1 <= index <= len(self.remaining):
                detail = self.remaining[index - 1]
                if not any(detail is p for p in picked):
                    picked.append(detail)
        return picked


def _numbered(details: list[dict[str, Any]]) -> str:
    return "\n".join(
        f"{i}. [{prompts.IMPORTANCE.get(str(d['importance']), 'LOW')}] {d['description']} "
        f"(a question like: {d.get('inquiry', '')})"
        for i, d in enumerate(details, 1)
    )


def _hidden(details: list[dict[str, Any]]) -> str:
    return "\n".join(f"- {d['description']} (options you consider: {', '.join(d.get('options', []))})" for d in details)


register_gym(
    "intention",
    config_type=IntentionGymConfig,
    needs_user_sim=True,
    userrl_env="IntentionGym",
    tasks=intention_tasks,
    smoke=intention_smoke,
)(IntentionGym)
