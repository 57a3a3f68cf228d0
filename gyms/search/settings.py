"""Settings of SearchGym, config section `gyms.search`: each field with its comment (`userrl config show
--explain`), their ranges and choices (`RANGES`, `CHOICES`). `max_steps` is replaced by the rollout's max turns
(`gyms.config_for`)."""

from dataclasses import dataclass
from typing import ClassVar

from userrl_megatron.config.rules import COUNT, NON_NEGATIVE, POSITIVE, Rule


@dataclass
class SearchGymConfig:
    """SearchGym and its search backend."""

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
