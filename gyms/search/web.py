"""The web search backend: a Serper-compatible JSON API over HTTP (`POST {"q": query, "num": n}`).

The API key is read from the environment variable the config names. Connection errors, timeouts, 429 and 5xx
are retried; a search that still fails raises SearchBackendError, which the gym turns into feedback.
"""

import asyncio
import os
import random
from typing import Any

from gyms.search.bm25 import Hit
from gyms.search.settings import SearchGymConfig
from userrl_megatron.errors import UserError

REQUEST_RESULTS = 15


class SearchBackendError(RuntimeError):
    """A web search that failed after its retries."""


class WebSearch:
    def __init__(self, cfg: SearchGymConfig) -> None:
        self.cfg = cfg
        self.api_key = os.environ.get(cfg.web_api_key_env, "")
        if not self.api_key:
            raise UserError(f"the web search backend needs an API key in ${cfg.web_api_key_env}")

    async def search(self, query: str, k: int) -> list[Hit]:
        import aiohttp

        headers = {"X-API-KEY": self.api_key, "Content-Type": "application/json"}
        timeout = aiohttp.ClientTimeout(total=self.cfg.web_timeout_s)
        problem = ""
        for attempt in range(self.cfg.web_retries + 1):
            if attempt:
                await asyncio.sleep(0.2 * 2 ** (attempt - 1) * (0.5 + random.random()))
            try:
                async with (
                    aiohttp.ClientSession(timeout=timeout) as session,
                    session.post(self.cfg.web_url, json={"q": query, "num": REQUEST_RESULTS}, headers=headers) as r,
                ):
                    if r.status == 429 or r.status >= 500:
                        problem = f"HTTP {r.status}"
                        continue
                    if r.status >= 400:
                        raise SearchBackendError(f"web search rejected: HTTP {r.status}")
                    return parse_results(await r.json(content_type=None))[:k]
            except (aiohttp.ClientError, TimeoutError, ValueError) as e:
                problem = f"{type(e).__name__}: {e}"
        raise SearchBackendError(f"web search failed after {self.cfg.web_retries + 1} attempts: {problem}")


def parse_results(payload: dict[str, Any]) -> list[Hit]:
    """UserRL's selection: nothing without organic results (an answer box alone included: UserRL waits for organic
    results), else the answer box first when it has a title (its `answer` as an "Answer" line, else its `snippet`),
    then the organic results that have both a title and a snippet; values printed as they are."""
    if not payload.get("organic"):
        return []
    hits = []
    box = payload.get("answerBox")
    if isinstance(box, dict) and box and "title" in box:
        if "answer" in box:
            hits.append(Hit(str(box["title"]), str(box["answer"]), "Answer"))
        elif "snippet" in box:
            hits.append(Hit(str(box["title"]), str(box["snippet"])))
    for item in payload.get("organic") or []:
        if isinstance(item, dict) and "title" in item and "snippet" in item:
            hits.append(Hit(str(item["title"]), str(item["snippet"])))
    return hits
