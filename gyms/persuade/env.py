"""PersuadeGym: the persona starts at "Strongly Agree"; arguments that move it toward disagreement pay (§3.3).

Reward of a step = max(0, stance index gain) / 6, capped at 1. The gain is measured from the best stance so far
(`reward_baseline: best`, the default: the episode return is the total progress, at most 1.0) or, as in UserRL,
from the previous stance (`previous`: an oscillating persona pays again for the same ground). Reaching
"Strongly Disagree" ends the episode.
"""

from typing import Any

from gyms.base import StepResult, register_gym, task_record
from gyms.persuade import prompts
from gyms.persuade.replies import PERSONA, STANCES
from gyms.persuade.settings import PersuadeGymConfig
from gyms.persuade.tasks import persuade_record, persuade_smoke, persuade_tasks
from gyms.turn_gym import TurnGym
from gyms.user_sim import UserSimError

_STANCE_INDEX = {s: i for i, s in enumerate(STANCES)}  # spelled exactly so, as in UserRL


class PersuadeGym(TurnGym):
    name = "persuade"
    needs_user_sim = True
    fallback_feedback = "I'm having trouble understanding your argument right now."

    def __init__(self, task: Any, config: PersuadeGymConfig | None = None, user_sim: Any = None) -> None:
        self.config = config or PersuadeGymConfig()
        super().__init__(self.config.max_steps, user_sim)
        self.record = task_record(task, persuade_record)
        self.start()

    def start(self) -> None:
        self.stance = 0
        self.best_stance = 0
        self.history: list[tuple[str, str]] = []

    def observation(self) -> str:
        return (  # UserRL's text, byte for byte
            f"Welcome to PersuadeGym! I currently strongly agree with this statement: '{self.record['claim']}'. "
            f"Here's my reasoning: {self.record['argument']} Try to change my mind!"
        )

    async def act(self, tag: str | None, payload: str) -> StepResult:
        if tag == "finish":
            return StepResult("Conversation ended.", 0.0, done=True)
        if not payload:
            return StepResult("Please make an argument.", 0.0)
        history = "\n".join(f"Turn {i}:\nPersuader: {a}\nYou: {r}" for i, (a, r) in enumerate(self.history, 1))
        data = await self.ask(
            prompts.SYSTEM,
            prompts.USER.format(
                claim=self.record["claim"],
                argument=self.record["argument"],
                stance=STANCES[self.stance],
                history=history or "(none yet)",
                latest=payload,
            ),
            reply=PERSONA,
        )
        new = _STANCE_INDEX.get(data["stance"]) if isinstance(data["stance"], str) else None
        if new is None:
            raise UserSimError(f"persona stance {data['stance']!r} is not one of the 7 stances", "bad_json", 1)
        baseline = self.best_stance if self.config.reward_baseline == "best" else self.stance
        gain = new - baseline
        reward = 0.0 if gain <= 0 else min(1.0, round(gain / 6, 6))
        response = str(data["response"])  # as UserRL shows it: not stripped
        self.history.append((payload, response))
        self.stance, self.best_stance = new, max(self.best_stance, new)
        return StepResult(response, reward, done=new == len(STANCES) - 1, info={"stance": STANCES[new]})


register_gym(
    "persuade",
    config_type=PersuadeGymConfig,
    needs_user_sim=True,
    userrl_env="PersuadeGym",
    tasks=persuade_tasks,
    smoke=persuade_smoke,
)(PersuadeGym)
