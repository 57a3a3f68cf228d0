"""IntentionGym's simulator calls and the JSON object each answers with (`gyms/reply_schema.py`)."""

from gyms.reply_schema import ReplySchema, boolean, integers, text

USER = ReplySchema("intention_user", {"thought": text(), "response": text()}, needs=("response",))


def judge(details: int) -> ReplySchema:
    """The details a question covers, numbered from 1 in the judge's list of `details` (the gym also reads digit
    strings and ignores numbers outside the list, and reads a falsy `is_task_related` as covering nothing, as UserRL
    did)."""
    return ReplySchema(
        "intention_judge",
        {"analysis": text(), "is_task_related": boolean(), "covered_detail_numbers": integers(details)},
        needs=("covered_detail_numbers",),
    )
