"""SearchGym: search (offline BM25 corpus or a web API), then answer; exact match first, LLM judge fallback (§3.4).

A correct answer pays 1.0 and ends the episode; wrong answers pay 0 and the episode goes on. Searches beyond
`max_search_steps` are refused (and still use a step).
"""

from typing import Any

from gyms.base import StepResult, register_gym, task_record
from gyms.search import prompts, replies
from gyms.search.bm25 import Hit, OfflineSearch
from gyms.search.settings import SearchGymConfig
from gyms.search.tasks import search_record, search_smoke, search_tasks
from gyms.search.web import SearchBackendError, WebSearch
from gyms.turn_gym import TurnGym


def normalize(text: str) -> str:
    """The lower-cased alphanumeric characters, Unicode letters and digits included (UserRL's normalisation)."""
    return "".join(ch.lower() for ch in text if ch.isalnum())


# UserRL's texts, byte for byte (the policy learns from them).
SEARCH_LIMIT = (
    "You have reached the maximum number of search steps. Please provide an answer in your next action. "
    "Do not search again."
)
INVALID_ACTION = "Invalid action format. Please choose provide a search or answer in correct format."


class SearchGym(TurnGym):
    name = "search"

    def __init__(self, task: Any, config: SearchGymConfig | None = None, user_sim: Any = None) -> None:
        self.config = config or SearchGymConfig()
        self.needs_user_sim = self.config.judge == "llm"
        super().__init__(self.config.max_steps, user_sim)
        self.record = task_record(task, search_record)
        self.backend = (
            WebSearch(self.config) if self.config.backend == "web" else OfflineSearch(self.config.corpus_path)
        )
        self.start()

    def start(self) -> None:
        self.searches = 0
        self.solved = False

    def observation(self) -> str:
        return "New question loaded. You can [search] for information or [answer] directly."  # UserRL's

    def failure_feedback(self, tag: str | None, payload: str) -> str:
        """A failed judge call: UserRL's text for an answer judged wrong (its failed judge said "Error")."""
        return _incorrect(payload)

    async def act(self, tag: str | None, payload: str) -> StepResult:
        if tag == "search":
            return await self._search(payload)
        if tag == "answer":
            return await self._answer(payload)
        if tag == "finish":
            if self.solved:  # unreachable: a correct answer ends the episode (as in UserRL)
                return StepResult("Episode finished. You answered correctly!", 0.0, done=True)
            answer = self.record["answer"]
            return StepResult(
                f"Episode finished without correct answer. The correct answer was: {answer}", 0.0, done=True
            )
        return StepResult(INVALID_ACTION, 0.0)

    async def _search(self, query: str) -> StepResult:
        self.searches += 1  # an empty query counts too, as in UserRL
        if self.searches > self.config.max_search_steps:
            return StepResult(SEARCH_LIMIT, 0.0)
        if not query:
            return StepResult("Search query is empty. Please provide a search query.", 0.0)
        try:
            hits = await self.backend.search(query, self.config.max_search_results)
        except SearchBackendError as e:
            return StepResult(f"Search failed: {e}", 0.0, info={"search_error": str(e)})
        return StepResult(format_hits(query, hits), 0.0)

    async def _answer(self, answer: str) -> StepResult:
        if not answer:
            return StepResult("Answer is empty. Please provide an answer.", 0.0)
        correct = normalize(answer) == normalize(self.record["answer"]) and bool(normalize(answer))
        judged = False
        if not correct and self.config.judge == "llm":
            data = await self.ask(
                prompts.JUDGE_SYSTEM,
                prompts.JUDGE_USER.format(question=self.record["question"], gold=self.record["answer"], answer=answer),
                reply=replies.JUDGE,
                max_tokens=self.config.judge_max_tokens,
            )
            correct, judged = data["judgment"] == replies.CORRECT, True  # UserRL: exactly "Yes"
        info = {"correct": correct, "judged": judged}
        if correct:
            self.solved = True
            return StepResult(f"Correct! Your answer '{answer}' is correct.", 1.0, done=True, info=info)
        return StepResult(_incorrect(answer), 0.0, info=info)


def _incorrect(answer: str) -> str:
    return f"Incorrect. Your answer '{answer}' is not correct."


def format_hits(query: str, hits: list[Hit]) -> str:
    """UserRL's result layout: "<i>. <title>" and "- Answer: <answer>" or "- Snippet: <snippet>" per result, the
    block stripped of outer whitespace. No result at all: a line saying so (UserRL: a timeout text, see README)."""
    if not hits:
        return f"No results found for '{query}'."
    block = "".join(f"{i}. {hit.title}\n- {hit.label}: {hit.text}\n" for i, hit in enumerate(hits, 1))
    return f"Search results for '{query}':\n{block.strip()}"


register_gym(
    "search",
    config_type=SearchGymConfig,
    needs_user_sim=True,
    userrl_env="SearchGym",
    tasks=search_tasks,
    smoke=search_smoke,
)(SearchGym)
