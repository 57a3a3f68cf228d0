"""The NL-assertion judge (SPEC.md §9.2, item 5): an LLM grades the conversation against a task's `nl_assertions`.

The judge is a call of the episode's simulator client (same endpoint, model and retries), answered with
`replies.judgement` (schema-constrained where the engine supports it). It sees the conversation as `role: content`
lines and the numbered assertions. The component is 1 iff every assertion is met; no assertions give 1. A reply
that does not grade each assertion exactly once is a simulator error (`UserSimError`, kind `bad_json`).
"""

from typing import Any

from gyms.tau2.replies import judgement, parse_judgement
from gyms.user_sim import UserSimError

JUDGE_SYSTEM = (
    "You grade a conversation between a customer-service agent and a customer. For each expected outcome, decide "
    "from the conversation alone whether it was met. Reply with one JSON object: "
    '{"results": [{"expectedOutcome": "<the outcome, as given>", "reasoning": "<one or two sentences>", '
    '"metExpectation": true or false}, ...]}, one result per expected outcome, in the order given.'
)


def judge_request(transcript: list[tuple[str, str]], assertions: list[str]) -> str:
    """The judge's user message: the conversation, then the numbered expected outcomes."""
    lines = "\n".join(f"{role}: {content}" for role, content in transcript)
    outcomes = "\n".join(f"{i}. {a}" for i, a in enumerate(assertions, 1))
    return f"<conversation>\n{lines}\n</conversation>\n\n<expected_outcomes>\n{outcomes}\n</expected_outcomes>"


async def judge(
    user_sim: Any, transcript: list[tuple[str, str]], assertions: list[str], max_tokens: int | None = None
) -> tuple[float, list[dict[str, Any]]]:
    """(component, per-assertion results) for `assertions`; UserSimError when the judge fails or is unusable."""
    if not assertions:
        return 1.0, []
    messages = [{"role": "system", "content": JUDGE_SYSTEM}, {"role": "user", "content": judge_request(
        transcript, assertions)}]  # fmt: skip
    answer = await user_sim.chat(messages, max_tokens=max_tokens, json=True, schema=judgement(len(assertions)))
    results = parse_judgement(answer.data or {}, len(assertions))
    if results is None:
        note = getattr(user_sim, "unusable_reply", None)
        if note is not None:
            note()
        raise UserSimError(f"NL judge reply does not grade the {len(assertions)} assertions: {answer.text[:200]!r}",
                           "bad_json", 1)  # fmt: skip
    graded = [
        {"assertion": a, "met": bool(r["metExpectation"]), "reasoning": str(r.get("reasoning", ""))}
        for a, r in zip(assertions, results, strict=True)
    ]
    return float(all(g["met"] for g in graded)), graded
