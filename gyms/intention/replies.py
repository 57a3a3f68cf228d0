"""IntentionGym's simulator calls and the JSON object each answers with (`gyms/reply_schema.py`)."""

from gyms.reply_schema import ReplySchema, boolean, integers, text

USER = ReplySchema("intention_user", {"thought": text(), "response": text()}, needs=("response",))
# The details a question covers, numbered from 1 in the judge's list (the gym also reads digit strings, and a
# falsy `is_task_related` as covering nothing, as UserRL did).
JUDGE = ReplySchema(
    "intention_judge",
    {"analysis": text(), "is_task_related": boolean(), "covered_detail_numbers": integers()},
    needs=("covered_detail_numbers",),
)
