"""TurtleGym: yes/no questions about a hidden story, and stories graded against a weighted rubric
(UserRL, arXiv 2509.19736; github.com/SalesforceAIResearch/UserRL, `gyms/TurtleGym`).

Score of a story = sum of rubric weight x judgment (0, 0.5 or 1). Reward on `[answer]` is the improvement over the
best score so far, so the episode return is the best score reached; a story scoring at least
`success_threshold` ends the episode.
"""

from typing import Any

from gyms.base import StepResult, register_gym, task_record
from gyms.turn_gym import TurnGym
from gyms.turtle import prompts, replies
from gyms.turtle.replies import JUDGMENTS
from gyms.turtle.settings import TurtleGymConfig
from gyms.turtle.tasks import turtle_record, turtle_smoke, turtle_tasks
from gyms.user_sim import UserSimError

MORE_TWISTS = (
    "There might be more hidden twists that you haven't covered. Try to continue ask related questions and answer "
    "with creativity."
)


class TurtleGym(TurnGym):
    name = "turtle"
    needs_user_sim = True
    fallback_feedback = "Feedback not available currently. Please try again."  # UserRL's

    def __init__(self, task: Any, config: TurtleGymConfig | None = None, user_sim: Any = None) -> None:
        self.config = config or TurtleGymConfig()
        super().__init__(self.config.max_steps, user_sim)
        self.record = task_record(task, turtle_record)
        self.rubric = [(str(c["statement"]), float(c["score"])) for c in self.record["evaluation"]]
        self.best_score = 0.0

    def start(self) -> None:
        self.best_score = 0.0

    def observation(self) -> str:
        return "Welcome to the Turtle Soup Gym. Choose your action."  # UserRL's reset feedback

    async def act(self, tag: str | None, payload: str) -> StepResult:
        if tag == "finish":
            return StepResult("", 0.0, done=True)  # UserRL's [finish] feedback is empty
        if not payload:
            return StepResult("Please ask a yes-or-no question, or tell your story with [answer].", 0.0)
        surface, bottom = self.record["new_surface"], self.record["new_bottom"]
        if tag == "answer":
            return await self._grade(payload, surface, bottom)
        data = await self.ask(
            prompts.QUESTION_SYSTEM,
            prompts.QUESTION_USER.format(surface=surface, bottom=bottom, question=payload),
            reply=replies.QUESTION,
        )
        return StepResult(str(data["response"]), 0.0)  # the judge's word as it wrote it, as in UserRL

    async def _grade(self, story: str, surface: str, bottom: str) -> StepResult:
        rubric = "\n".join(f"{i}. {statement}" for i, (statement, _) in enumerate(self.rubric, 1))
        data = await self.ask(
            prompts.STORY_SYSTEM,
            prompts.STORY_USER.format(surface=surface, bottom=bottom, story=story, rubric=rubric),
            reply=replies.story(len(self.rubric)),
        )
        judgments = _judgments(data["scores"], len(self.rubric))
        score = round(sum(w * j for (_, w), j in zip(self.rubric, judgments, strict=True)), 6)
        reward = round(max(0.0, score - self.best_score), 6)
        self.best_score = max(self.best_score, score)
        # UserRL's text: the fully covered statements, the whole list stripped of outer whitespace
        covered = "".join(f"{s}: Covered\n" for (s, _), j in zip(self.rubric, judgments, strict=True) if j == 1.0)
        covered = covered.strip()
        if covered:
            feedback = f"Here's the evaluation points that your story effectively covers:\n{covered}\n{MORE_TWISTS}"
        else:
            feedback = "Your answer does not effectively cover any evaluation points."
        done = score >= self.config.success_threshold
        return StepResult(feedback, reward, done=done, info={"score": score})


def _judgments(scores: Any, expected: int) -> list[float]:
    """The judge's per-statement scores; UserSimError unless there is one valid score per rubric statement.

    As in UserRL, each entry is an object whose `score` is a number (a bare number or a string such as "0.5" fails
    the reply); here it must also be one of 0, 0.5, 1.
    """
    if not isinstance(scores, list) or len(scores) != expected:
        count = len(scores) if isinstance(scores, list) else type(scores).__name__
        raise UserSimError(f"grader returned {count} scores for {expected} rubric statements", "bad_json", 1)
    out = []
    for entry in scores:
        grade = entry.get("score") if isinstance(entry, dict) else None
        value = float(grade) if isinstance(grade, int | float) and not isinstance(grade, bool) else -1.0
        if value not in JUDGMENTS:
            raise UserSimError(f"grader score {entry!r} is not one of 0, 0.5, 1", "bad_json", 1)
        out.append(value)
    return out


register_gym(
    "turtle",
    config_type=TurtleGymConfig,
    needs_user_sim=True,
    userrl_env="TurtleGym",
    tasks=turtle_tasks,
    smoke=turtle_smoke,
)(TurtleGym)
