"""SearchGym: exact match and the LLM judge (real HTTP), the search limit, BM25, the web backend."""

import json
import math
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiohttp import web

import gyms
from gyms.search.bm25 import BM25Index, Hit, load_corpus, tokenize
from gyms.search.env import normalize
from gyms.search.settings import SearchGymConfig
from tests.support.gym_play import SIM_TIMEOUT_S, play_new, sim_for
from tests.support.openai_server import Handler, OpenAIServer, sequence, when
from userrl_megatron.config.schema import GymsConfig
from userrl_megatron.data import load_tasks
from userrl_megatron.errors import UserError

RECORD = {"id": "Bamboogle-x", "question": "Who founded the city of Rome?", "answer": "Romulus"}
DOCS = [
    {"title": "Rome", "text": "Romulus founded Rome."},
    {"title": "Paris", "text": "Paris is in France."},
    {"title": "Remus", "text": "Remus was the brother of Romulus."},
]
EXACT = SearchGymConfig(judge="exact")
NO = '{"reasoning": "", "judgment": "No", "feedback": ""}'
YES = '{"reasoning": "", "judgment": "Yes", "feedback": ""}'


@pytest.fixture
def server() -> Iterator[OpenAIServer]:
    with OpenAIServer() as s:
        yield s


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    path = tmp_path / "corpus.jsonl"
    path.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    return path


def test_exact_match_needs_no_judge(server: OpenAIServer) -> None:
    server.rules = [when("You judge answers", NO)]
    results = play_new("search", RECORD, ["[answer] Remus", "[answer]  ROMULUS."], user_sim=sim_for(server))
    assert [(r.feedback, r.reward, r.done) for r in results] == [
        ("Incorrect. Your answer 'Remus' is not correct.", 0.0, False),
        ("Correct! Your answer 'ROMULUS.' is correct.", 1.0, True),
    ]
    assert server.count == 1  # only "Remus" went to the judge
    assert results[1].info == {"correct": True, "judged": False, "step": 2}
    assert normalize("  Romulus, the founder!") == "romulusthefounder"


def test_llm_judge_decides_other_answers(server: OpenAIServer) -> None:
    server.rules = [when("You judge answers", sequence(NO, YES))]
    results = play_new("search", RECORD, ["[answer] Remus", "[answer] the first king"], user_sim=sim_for(server))
    assert [(r.reward, r.done, r.info["judged"]) for r in results] == [(0.0, False, True), (1.0, True, True)]
    assert server.requests[1]["messages"][1]["content"] == (
        "Question: Who founded the city of Rome?\n\nReference answer: Romulus\n\nModel's answer: the first king"
    )


def test_exact_judge_mode_needs_no_simulator() -> None:
    results = play_new("search", RECORD, ["[answer] the first king", "[finish]"], config=EXACT)
    assert [r.reward for r in results] == [0.0, 0.0]
    assert results[1].feedback == "Episode finished without correct answer. The correct answer was: Romulus"
    with pytest.raises(ValueError, match="gym search needs a user simulator"):
        gyms.make_gym("search", RECORD)


def test_offline_search_and_the_search_limit(corpus: Path) -> None:
    config = SearchGymConfig(judge="exact", corpus_path=str(corpus), max_search_steps=2, max_search_results=2)
    actions = ["[search] romulus rome", "[search] eiffel", "[search] rome", "[search]", "what?"]
    results = play_new("search", RECORD, actions, config=config)
    limit = (
        "You have reached the maximum number of search steps. Please provide an answer in your next action. "
        "Do not search again."
    )
    assert [r.feedback for r in results] == [
        "Search results for 'romulus rome':\n1. Rome\n- Snippet: Romulus founded Rome.\n"
        "2. Remus\n- Snippet: Remus was the brother of Romulus.",
        "No results found for 'eiffel'.",  # UserRL: a timeout text (README: deliberate differences)
        limit,
        limit,
        "Invalid action format. Please choose provide a search or answer in correct format.",
    ]
    assert [r.done for r in results] == [False] * 5


def test_an_empty_search_counts_toward_the_limit_as_in_userrl(corpus: Path) -> None:
    config = SearchGymConfig(judge="exact", corpus_path=str(corpus), max_search_steps=2)
    results = play_new("search", RECORD, ["[search]", "[search]   ", "[search] rome"], config=config)
    assert [r.feedback for r in results] == [
        "Search query is empty. Please provide a search query.",
        "Search query is empty. Please provide a search query.",
        "You have reached the maximum number of search steps. Please provide an answer in your next action. "
        "Do not search again.",
    ]


@pytest.mark.parametrize(
    ("action", "feedback"),
    [
        ("[answer]", "Answer is empty. Please provide an answer."),
        ("[answer]   ", "Answer is empty. Please provide an answer."),
        ("[action] Romulus", "Invalid action format. Please choose provide a search or answer in correct format."),
        ("Romulus", "Invalid action format. Please choose provide a search or answer in correct format."),
    ],
)
def test_bad_actions_get_userrls_texts(action: str, feedback: str) -> None:
    (result,) = play_new("search", RECORD, [action], config=EXACT)
    assert (result.feedback, result.reward, result.done) == (feedback, 0.0, False)


def test_reset_and_finish_texts_are_userrls() -> None:
    import asyncio

    gym = gyms.make_gym("search", RECORD, config=EXACT)
    assert asyncio.run(gym.reset()) == "New question loaded. You can [search] for information or [answer] directly."
    gym.solved = True  # unreachable in play (a correct answer ends the episode), as in UserRL
    assert asyncio.run(gym.act("finish", "")).feedback == "Episode finished. You answered correctly!"


def test_offline_results_are_snippets_and_documents_without_text_are_skipped(tmp_path: Path) -> None:
    path = tmp_path / "corpus.jsonl"
    docs = [
        {"title": "Rome alone"},  # no text: skipped, as UserRL skips a result without a snippet
        {"title": "Rome", "text": "Romulus  founded\n Rome. " + "x" * 500},
        {"title": "Paris", "text": "Paris is far from Rome, and other words."},
    ]
    path.write_text("".join(json.dumps(d) + "\n" for d in docs))
    config = SearchGymConfig(judge="exact", corpus_path=str(path), max_search_results=2)
    (result,) = play_new("search", RECORD, ["[search] rome"], config=config)
    text = "Romulus founded Rome. " + "x" * 500
    assert result.feedback == (
        f"Search results for 'rome':\n1. Rome\n- Snippet: {text[:400]}...\n"
        "2. Paris\n- Snippet: Paris is far from Rome, and other words."
    )


@pytest.mark.parametrize(
    ("gold", "answer", "exact"),
    [
        ("Gödel", "Godel", False),  # UserRL keeps "ö": the judge decides (the ASCII-only match said "gdel" twice)
        ("Gödel", "Gdel", False),
        ("Gödel", "GÖDEL!", True),
        ("São Paulo", "sao paulo", False),
        ("Romulus", "romulus", True),
        ("½", "1/2", False),
    ],
)
def test_exact_match_keeps_unicode_letters_as_userrl(server: OpenAIServer, gold: str, answer: str, exact: bool):
    server.rules = [when("You judge answers", NO)]
    (result,) = play_new("search", {**RECORD, "answer": gold}, [f"[answer] {answer}"], user_sim=sim_for(server))
    assert (result.reward, result.info["judged"]) == ((1.0, False) if exact else (0.0, True))


@pytest.mark.parametrize(
    "reply",
    [
        '{"reasoning": "", "judgment": "yes", "feedback": ""}',  # UserRL counts only "Yes"
        '{"reasoning": "", "judgment": "Yes ", "feedback": ""}',
        '{"reasoning": "", "judgment": true, "feedback": ""}',
    ],
)
def test_only_an_exact_yes_is_a_correct_judgment(server: OpenAIServer, reply: str) -> None:
    server.rules = [when("You judge answers", reply)]
    (result,) = play_new("search", RECORD, ["[answer] the first king"], user_sim=sim_for(server))
    assert (result.reward, result.done, result.info["correct"]) == (0.0, False, False)


def test_a_judge_reply_without_reasoning_or_feedback_is_a_simulator_error(server: OpenAIServer) -> None:
    server.rules = [when("You judge answers", '{"judgment": "Yes"}')]
    (result,) = play_new("search", RECORD, ["[answer] the first king"], user_sim=sim_for(server))
    assert (result.reward, result.done) == (0.0, False)
    assert result.user_sim_error.startswith("simulator reply lacks reasoning, feedback")


def test_the_judge_gets_userrls_token_limit(server: OpenAIServer) -> None:
    server.rules = [when("You judge answers", YES)]
    play_new("search", RECORD, ["[answer] the first king"], user_sim=sim_for(server, max_tokens=2048))
    assert server.requests[0]["max_tokens"] == 512
    config = SearchGymConfig(judge_max_tokens=64)
    play_new("search", RECORD, ["[answer] the first king"], config=config, user_sim=sim_for(server))
    assert server.requests[1]["max_tokens"] == 64


def test_a_long_query_costs_only_its_distinct_terms(corpus: Path) -> None:
    """BM25 walks the postings of each distinct query term once: a 1,000,000-token query answers like its terms."""
    index = BM25Index([Hit(d["title"], d["text"]) for d in DOCS])
    long_query = "romulus " * 500_000 + "rome " * 500_000
    assert index.scores(long_query) == pytest.approx([500_000 * s for s in index.scores("romulus rome")], rel=1e-9)
    assert [h.title for h in index.search(long_query, 3)] == ["Rome", "Remus"]


def test_bm25_scores_match_the_formula() -> None:
    index = BM25Index([Hit(d["title"], d["text"]) for d in DOCS])
    scores = index.scores("founded romulus")
    lengths = [4, 5, 7]  # "rome romulus founded rome", "paris paris is in france", "remus remus was the brother..."
    avg = sum(lengths) / 3

    def term(df: int, tf: int, length: int) -> float:
        idf = math.log(1 + (3 - df + 0.5) / (df + 0.5))
        return idf * tf * 2.5 / (tf + 1.5 * (0.25 + 0.75 * length / avg))

    assert scores == pytest.approx([term(1, 1, 4) + term(2, 1, 4), 0.0, term(2, 1, 7)], abs=1e-12)
    assert [h.title for h in index.search("founded romulus", 5)] == ["Rome", "Remus"]
    assert tokenize("Hello, World-2!") == ["hello", "world", "2"]


def test_corpus_folder_and_bad_corpora(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "Romulus.md").write_text("Founder of Rome.")
    (tmp_path / "docs" / "skip.bin").write_text("ignored")
    assert load_corpus(tmp_path / "docs") == [Hit("Romulus", "Founder of Rome.")]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"title": "a", "text": "b"}\nnot json\n')
    with pytest.raises(UserError, match=r"bad\.jsonl:2: not a JSON object with title and text"):
        load_corpus(bad)
    with pytest.raises(UserError, match=r"a search corpus is a \.jsonl file or a folder"):
        load_corpus(tmp_path / "docs" / "skip.bin")
    with pytest.raises(UserError, match=r"gyms\.search\.corpus_path '/nope' does not exist"):
        gyms.make_gym("search", RECORD, config=SearchGymConfig(judge="exact", corpus_path="/nope"))


def _serper(replies: list[tuple[int, dict]], seen: list[tuple[dict, str]]) -> Handler:
    """A search API stub answering (status, payload) in turn (the last one repeats)."""

    async def handler(request: web.Request) -> web.Response:
        seen.append((await request.json(), request.headers.get("X-API-KEY", "")))
        status, payload = replies.pop(0) if len(replies) > 1 else replies[0]
        return web.json_response(payload, status=status)

    return handler


def _web_config(server: OpenAIServer, **overrides: object) -> SearchGymConfig:
    config = SearchGymConfig(
        judge="exact",
        backend="web",
        web_url=f"{server.root_url}/search",
        web_api_key_env="TEST_SERPER_KEY",
        web_timeout_s=SIM_TIMEOUT_S,  # only a hang reaches it
    )
    for key, value in overrides.items():
        setattr(config, key, value)
    return config


def test_web_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    payload = {
        "answerBox": {"title": "Founder", "answer": "Romulus"},
        "organic": [{"title": "Rome - Wikipedia", "snippet": "Rome was founded by Romulus.", "link": "x"}],
    }
    seen: list[tuple[dict, str]] = []
    monkeypatch.setenv("TEST_SERPER_KEY", "k-123")
    with OpenAIServer(routes={"/search": _serper([(503, {}), (200, payload)], seen)}) as s:
        (result,) = play_new("search", RECORD, ["[search] founder of rome"], config=_web_config(s))
    assert result.feedback == (
        "Search results for 'founder of rome':\n1. Founder\n- Answer: Romulus\n"
        "2. Rome - Wikipedia\n- Snippet: Rome was founded by Romulus."
    )
    assert seen == [({"q": "founder of rome", "num": 15}, "k-123")] * 2  # one retry after the 503


@pytest.mark.parametrize(
    ("payload", "feedback"),
    [
        (  # a result without a snippet is skipped (no number used); an answer box without a title is dropped
            {
                "answerBox": {"answer": "Romulus"},
                "organic": [{"title": "No snippet", "link": "x"}, {"title": "Rome", "snippet": "Founded by Romulus."}],
            },
            "Search results for 'q':\n1. Rome\n- Snippet: Founded by Romulus.",
        ),
        (  # an answer box with a snippet but no answer is a Snippet line; values are printed as they are
            {
                "answerBox": {"title": "Founder", "snippet": "Romulus and Remus "},
                "organic": [{"title": 7, "snippet": "  spaced  out  "}, {"snippet": "no title"}],
            },
            "Search results for 'q':\n1. Founder\n- Snippet: Romulus and Remus \n2. 7\n- Snippet:   spaced  out",
        ),
        (  # the answer box counts toward max_search_results (2 here)
            {
                "answerBox": {"title": "A", "answer": "", "snippet": "s"},
                "organic": [{"title": "B", "snippet": "b"}, {"title": "C", "snippet": "c"}],
            },
            "Search results for 'q':\n1. A\n- Answer: \n2. B\n- Snippet: b",
        ),
        ({"organic": [{"title": "No snippet"}]}, "No results found for 'q'."),
        # no organic result: nothing found, even with an answer box (UserRL waits for organic results)
        ({"answerBox": {"title": "Founder", "answer": "Romulus"}, "organic": []}, "No results found for 'q'."),
        ({"answerBox": {"title": "Founder", "snippet": "Romulus"}}, "No results found for 'q'."),
    ],
)
def test_web_results_use_userrls_layout(monkeypatch: pytest.MonkeyPatch, payload: dict, feedback: str) -> None:
    monkeypatch.setenv("TEST_SERPER_KEY", "k")
    with OpenAIServer(routes={"/search": _serper([(200, payload)], [])}) as s:
        (result,) = play_new("search", RECORD, ["[search] q"], config=_web_config(s, max_search_results=2))
    assert result.feedback == feedback


def test_web_backend_failure_is_feedback_not_a_crash(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[tuple[dict, str]] = []
    monkeypatch.setenv("TEST_SERPER_KEY", "k")
    with OpenAIServer(routes={"/search": _serper([(500, {})], seen)}) as s:
        first, second = play_new(
            "search", RECORD, ["[search] q", "[answer] Romulus"], config=_web_config(s, web_retries=1)
        )
    assert (
        first.feedback == "Search failed: web search failed after 2 attempts: HTTP 500"
    )  # UserRL: "Search failed: <e>"
    assert first.info["search_error"] == "web search failed after 2 attempts: HTTP 500"
    assert (second.reward, len(seen)) == (1.0, 2)


def test_web_backend_needs_its_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SERPER_API_KEY", raising=False)
    with pytest.raises(UserError, match=r"the web search backend needs an API key in \$SERPER_API_KEY"):
        gyms.make_gym("search", RECORD, config=SearchGymConfig(judge="exact", backend="web"))


def test_tasks_from_public_data(shared_data: Path) -> None:
    cfg = GymsConfig(data_dir=str(shared_data))
    tasks = load_tasks(["search"], "test", cfg)
    assert len(tasks) == 125 and tasks[0].task_id == "Bamboogle-19"
    assert tasks[0].metadata["record"]["answer"] == "November 6, 1905"
    with pytest.raises(UserError, match="gym search has no 'train' split; its splits: test"):
        load_tasks(["search"], "train", cfg)
