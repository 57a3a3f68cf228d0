"""TelepathyGym: the simulator answers yes/no questions about a hidden entity and judges guesses
(UserRL, arXiv 2509.19736; github.com/SalesforceAIResearch/UserRL, `gyms/TelepathyGym`).

Reward only on `[answer]`: the improvement of the guess score (1 for a correct guess, else 0) over the best so
far, so an episode returns at most 1.0; a correct guess ends the episode.
"""

from typing import Any

from gyms.base import StepResult, register_gym, task_record
from gyms.telepathy import prompts, replies
from gyms.telepathy.settings import TelepathyGymConfig
from gyms.telepathy.tasks import telepathy_record, telepathy_smoke, telepathy_tasks
from gyms.turn_gym import TurnGym

WELCOME = "Welcome to TelepathyGym! I'm thinking of something... Ask me yes/no questions to figure out what it is!"


class TelepathyGym(TurnGym):
    name = "telepathy"
    needs_user_sim = True
    fallback_feedback = "Unable to respond to your question right now."  # UserRL's texts for a failed call

    def failure_feedback(self, tag: str | None, payload: str) -> str:
        return "Unable to evaluate your guess right now." if tag == "answer" else self.fallback_feedback

    def __init__(self, task: Any, config: TelepathyGymConfig | None = None, user_sim: Any = None) -> None:
        self.config = config or TelepathyGymConfig()
        super().__init__(self.config.max_steps, user_sim)
        self.record = task_record(task, telepathy_record)
        self.best_score = 0.0

    def start(self) -> None:
        self.best_score = 0.0

    def observation(self) -> str:
        return WELCOME  # UserRL's reset feedback (the entity's description is in the task prompt)

    async def act(self, tag: str | None, payload: str) -> StepResult:
        if tag == "finish":
            return StepResult("Game finished.", 0.0, done=True)
        if not payload:
            return StepResult("Please ask a yes-or-no question, or give your guess with [answer].", 0.0)
        entity = self.record["target_entity"]
        if tag == "answer":
            data = await self.ask(
                prompts.GUESS_SYSTEM, prompts.GUESS_USER.format(entity=entity, guess=payload), reply=replies.GUESS
            )
            correct = data["judgment"] == replies.CORRECT  # UserRL: exactly "Yes"
            score = 1.0 if correct else 0.0
            reward = max(0.0, score - self.best_score)
            self.best_score = max(self.best_score, score)
            feedback = str(data["feedback"])
            return StepResult(feedback, reward, done=correct, info={"correct": correct})
        data = await self.ask(
            prompts.QUESTION_SYSTEM,
            prompts.QUESTION_USER.format(entity=entity, question=payload),
            reply=replies.QUESTION,
        )
        return StepResult(str(data["response"]).strip(), 0.0)


register_gym(
    "telepathy",
    config_type=TelepathyGymConfig,
    needs_user_sim=True,
    userrl_env="TelepathyGym",
    tasks=telepathy_tasks,
    smoke=telepathy_smoke,
)(TelepathyGym)
