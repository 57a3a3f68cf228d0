"""TravelGym: elicit hidden preferences, search, and recommend one option per travel aspect
(UserRL, arXiv 2509.19736; github.com/SalesforceAIResearch/UserRL, `gyms/TravelGym`).

Rewards (config): a correct first search of an aspect `search_correct_reward`; a question that uncovers a hidden
preference `preference_correct_reward`; recommending the best option `choice_best_reward`, a correct one
`choice_correct_reward`, anything else (an id that already paid too, as in UserRL) 0. Every
`search_failure_interval`-th search fails on purpose; after `elicitation_interval` utterances that uncover nothing
the traveller volunteers a preference (reward 0). The episode ends when the best option of every aspect is found,
or (one choice per aspect) when every aspect has a recommendation. UserRL's async-path bugs are fixed; see
gyms/README.md.
"""

import json
import random
import re
from typing import Any

from gyms.base import StepResult, register_gym, task_record
from gyms.travel import prompts, replies
from gyms.travel.catalog import ASPECT_INITIALS, OPTION_SCHEMAS
from gyms.travel.generator import generate_scenario
from gyms.travel.settings import TravelGymConfig
from gyms.travel.tasks import travel_smoke, travel_tasks
from gyms.turn_gym import TurnGym
from gyms.user_sim import UserSimError

INITIAL_ASPECTS = {initial: aspect for aspect, initial in ASPECT_INITIALS.items()}
_OPTION_ID = re.compile(r"^[ACFHR]\d+$")
# Observation texts: UserRL's (travelgym/env/prompts.py) byte for byte, except those listed in gyms/README.md.
SEARCH_FAILED = "Currently the searching backend is experiencing some issues. Please try again later."
_REFINE = (
    "Please refine your search request to 1. align with user's need, 2. make only one request attempt at a time, "
    "and 3. cover and only cover correct search request arguments."
)
SEARCH_MISMATCH = (
    "There's something wrong within your searching request, or the arguments in your request is not accurate. "
    + _REFINE
)
SEARCH_UNRELATED = (  # verdict "N/A"
    "You have provided the correct search request arguments. However, the arguments are not related to any of the "
    "ground truth search arguments. " + _REFINE
)
SEARCH_CORRECT = "You have provided the correct search request arguments."
SEARCH_REPEATED = (
    SEARCH_CORRECT + " However, you have already got the search results for <{aspect}> in previous search attempts. "
    "Please directly refer to the previous search results."
)
NO_SUCH_PREFERENCE = (
    "This is a good question. However, I do not have specific preference in the aspect you ask about yet (or maybe "
    "I have already elicited that to you before). You may continue to ask me about other detailed and specific "
    "preferences."
)
TOO_VAGUE = (
    "Your question is too vague and general, and I am not sure how to respond to it. Please ask me about some "
    "specific aspects of my preferences, in a more detailed and concrete way, so that I can provide you with a more "
    "accurate response."
)
CANNOT_REPLY = "I'm sorry, I'm not sure how to respond to your latest utterance right now. Please try again."
MULTIPLE_CHOICES = "You have chosen multiple options. Please choose only one option at a time."
BAD_OPTION_ID = "Invalid option ID format detected for '{id}'. Expected format: H1, F12, C4, etc."
ASPECT_CHOSEN = (
    "You have already recommended an option with the same initial '{initial}'. You are allowed to recommend only one "
    "option per traveling aspect. Please focus on the search, user preference, and option recommendation on other "
    "traveling aspects now."
)
CHOICE_BEST = "Your chosen options contain the best option!"
CHOICE_CORRECT = "Your chosen options contain the correct option, but not the best option."
CHOICE_WRONG = "Your chosen options do not contain any of the best or correct options."
RECORDED_ONE_PER_ASPECT = (
    " Your choice is recorded and do not choose options of this travel aspect again. Please continue your "
    "interaction and reasoning focusing on other travel aspects."
)
RECORDED = (
    " Your choice is recorded and do not choose these options again. Please continue your interaction and reasoning."
)
BAD_FORMAT = "Your response format is wrong and cannot be parsed properly."


class TravelGym(TurnGym):
    name = "travel"
    needs_user_sim = True
    fallback_feedback = CANNOT_REPLY

    def __init__(self, task: Any, config: TravelGymConfig | None = None, user_sim: Any = None) -> None:
        self.config = config or TravelGymConfig()
        super().__init__(self.config.max_steps, user_sim)
        record = task_record(task, lambda scenario_id: {"id": scenario_id})
        self.scenario = record if "aspects" in record else generate_scenario(record["id"])
        self.start()

    def start(self) -> None:
        self.remaining: list[dict[str, Any]] = list(self.scenario["preferences"])
        self.elicited: list[str] = []  # ids of the preferences uncovered (asked or volunteered)
        self.history: list[tuple[str, str]] = []
        self.unsearched = list(self.scenario["dimensions"])
        self.searches = 0
        self.off_preference = 0
        self.chosen: list[str] = []  # aspects with a recommendation
        self.best_found: list[str] = []  # aspects whose best option was recommended
        self.scored: list[str] = []  # option ids that paid best or correct: as in UserRL, a repeat pays nothing
        self.rng = random.Random(f"travel-elicit:{self.scenario['id']}")

    def observation(self) -> str:
        return self.scenario["initial_description"]

    async def act(self, tag: str | None, payload: str) -> StepResult:
        if tag == "search":
            try:
                return await self._search(payload)
            except UserSimError as e:
                return self._say(payload, SEARCH_FAILED, 0.0, role="Database", error=e)
        if tag == "action":
            return await self._talk(payload)
        if tag == "answer":
            return self._recommend(payload)
        if tag == "finish":
            elicited, total = len(self.elicited), len(self.elicited) + len(self.remaining)
            ratio = elicited / total if total else 0.0
            summary = (
                f"Session ended. You elicited {elicited}/{total} preferences. Final elicitation ratio: {ratio:.2%}"
            )
            return StepResult(summary, 0.0, True)
        return StepResult(BAD_FORMAT, 0.0)

    # -------------------------------------------------------------------------------------------------- search

    async def _search(self, request: str) -> StepResult:
        self.searches += 1
        interval = self.config.search_failure_interval
        if interval and self.searches % interval == 0:
            return self._say(request, SEARCH_FAILED, 0.0, role="Database", info={"search_failure": True})
        arguments = "\n\n".join(
            f"Aspect: {aspect}\n{json.dumps(spec['arguments'], indent=2)}"
            for aspect, spec in self.scenario["aspects"].items()
        )
        data = await self.ask(
            prompts.SEARCH_JUDGE_SYSTEM,
            prompts.SEARCH_JUDGE_USER.format(request=request, arguments=arguments),
            reply=replies.SEARCH_JUDGE,
        )
        verdict = data["alignment_judgement"]
        if verdict not in replies.VERDICTS:  # UserRL: any other value fails the search judge
            raise UserSimError(f"search judge verdict {verdict!r} is not True, False or N/A", "bad_json", 1)
        if verdict == "False":
            return self._say(request, SEARCH_MISMATCH, 0.0, role="Database")
        if verdict == "N/A":
            return self._say(request, SEARCH_UNRELATED, 0.0, role="Database")
        aspect = str(data.get("alignment_aspect", "")).strip().lower().replace(" ", "_")
        aspect = "rental_car" if aspect == "car_rental" else aspect
        if aspect not in self.scenario["dimensions"]:  # UserRL: a failed assertion, answered as a backend failure
            return self._say(request, SEARCH_FAILED, 0.0, role="Database", info={"search_aspect_not_in_trip": aspect})
        if aspect not in self.unsearched:
            return self._say(request, SEARCH_REPEATED.format(aspect=aspect), 0.0, role="Database")
        self.unsearched.remove(aspect)
        lines = [json.dumps(o) for o in self.scenario["aspects"][aspect]["options"]]
        feedback = (
            f"{SEARCH_CORRECT}\n\n{OPTION_SCHEMAS[aspect]}\n\nHere are all the options for <{aspect}>:\n"
            + "\n".join(lines)
        )
        self.history += [("Agent", request), ("Database", f"(the options for <{aspect}>)")]
        return StepResult(feedback, self.config.search_correct_reward, info={"searched": aspect})

    # ------------------------------------------------------------------------------------------------- dialogue

    async def _talk(self, utterance: str) -> StepResult:
        if not utterance:
            return StepResult("Please say something to the user.", 0.0)
        try:
            judged = await self.ask(
                prompts.UTTERANCE_JUDGE_SYSTEM,
                prompts.UTTERANCE_JUDGE_USER.format(
                    scenario=self.scenario["scenario"],
                    history=self._history(),
                    utterance=utterance,
                    preferences="\n".join(f"{p['id']} ({p['aspect']}): {p['preference']}" for p in self.remaining)
                    or "(none left)",
                ),
                reply=replies.UTTERANCE_JUDGE,
            )
            kind = str(judged["type"]).strip()
            asked = next((p for p in self.remaining if p["id"] == str(judged.get("preference_id", "")).strip()), None)
            if kind == "2" and asked is not None:
                reply = await self._reveal(prompts.REVEAL_SYSTEM, asked, utterance)
                self.off_preference = 0
                return self._say(
                    utterance, reply, self.config.preference_correct_reward, info={"elicited": asked["id"]}
                )
            if self.off_preference >= self.config.elicitation_interval and self.remaining:
                volunteered = self.rng.choice(self.remaining)
                reply = await self._reveal(prompts.ELICIT_SYSTEM, volunteered, utterance)
                self.off_preference = 0
                return self._say(utterance, reply, 0.0, info={"volunteered": volunteered["id"]})
            if kind == "3":
                reply = NO_SUCH_PREFERENCE
            elif kind == "4":
                reply = TOO_VAGUE
            else:
                data = await self.ask(
                    prompts.NATURAL_SYSTEM,
                    prompts.NATURAL_USER.format(history=self._history(), utterance=utterance),
                    reply=replies.TRAVELLER,
                )
                reply = str(data["response"]).strip()
        except UserSimError as e:
            return self._say(utterance, CANNOT_REPLY, 0.0, error=e)
        self.off_preference += 1
        return self._say(utterance, reply, 0.0, info={"utterance_type": kind})

    async def _reveal(self, system: str, preference: dict[str, Any], utterance: str) -> str:
        """The traveller's reply hinting at `preference`, which then counts as uncovered."""
        data = await self.ask(
            system,
            prompts.PREFERENCE_USER.format(
                aspect=preference["aspect"],
                preference=preference["preference"],
                implicit=preference["implicit_elicitation"],
                history=self._history(),
                utterance=utterance,
            ),
            reply=replies.TRAVELLER,
        )
        self.remaining = [p for p in self.remaining if p["id"] != preference["id"]]
        self.elicited.append(preference["id"])
        return str(data["response"]).strip()

    # ---------------------------------------------------------------------------------------------- recommend

    def _recommend(self, payload: str) -> StepResult:
        ids = [part.strip() for part in payload.split(",")]  # as UserRL: "H1," is two ids, "h1" is not an id
        if len(ids) > 1:
            return StepResult(MULTIPLE_CHOICES, 0.0)
        option_id = ids[0]
        if not _OPTION_ID.match(option_id):
            return StepResult(BAD_OPTION_ID.format(id=option_id), 0.0)
        aspect = INITIAL_ASPECTS[option_id[0]]
        if aspect not in self.scenario["dimensions"]:
            return StepResult(f"This trip has no {aspect.replace('_', ' ')} to book.", 0.0)
        if self.config.one_choice_per_aspect and aspect in self.chosen:
            return StepResult(ASPECT_CHOSEN.format(initial=option_id[0]), 0.0)
        spec = self.scenario["aspects"][aspect]
        if option_id in self.scored:  # UserRL removes a scored id from its best and correct lists
            reward, verdict = 0.0, CHOICE_WRONG
        elif option_id == spec["best_id"]:
            reward, verdict = self.config.choice_best_reward, CHOICE_BEST
            self.best_found.append(aspect)
            self.scored.append(option_id)
        elif option_id in spec["correct_ids"]:
            reward, verdict = self.config.choice_correct_reward, CHOICE_CORRECT
            self.scored.append(option_id)
        else:
            reward, verdict = 0.0, CHOICE_WRONG
        if aspect not in self.chosen:
            self.chosen.append(aspect)
        if self.config.one_choice_per_aspect:
            self.remaining = [p for p in self.remaining if p["aspect"] != aspect]
            verdict += RECORDED_ONE_PER_ASPECT
        else:
            verdict += RECORDED
        all_best = len(self.best_found) == len(self.scenario["dimensions"])
        all_chosen = self.config.one_choice_per_aspect and len(self.chosen) == len(self.scenario["dimensions"])
        return StepResult(verdict, reward, done=all_best or all_chosen, info={"choice": option_id, "aspect": aspect})

    # ------------------------------------------------------------------------------------------------ helpers

    def _say(
        self,
        said: str,
        reply: str,
        reward: float,
        role: str = "User",
        info: dict | None = None,
        error: UserSimError | None = None,
    ) -> StepResult:
        """Record the exchange in the history and answer `reply`; `error`: the simulator failed for good and `reply`
        is the fallback (`StepResult.user_sim_error`, so the episode is not scored)."""
        self.history += [("Agent", said), (role, reply)]
        return StepResult(reply, reward, info=info or {}, user_sim_error=None if error is None else str(error))

    def _history(self) -> str:
        return "\n".join(f"{role}: {text}" for role, text in self.history) or "(no conversation yet)"


register_gym(
    "travel",
    config_type=TravelGymConfig,
    needs_user_sim=True,
    userrl_env="TravelGym",
    tasks=travel_tasks,
    smoke=travel_smoke,
)(TravelGym)
