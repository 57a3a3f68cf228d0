"""SearchGym's simulator call (the answer judge) and the JSON object it answers with (`gyms/reply_schema.py`)."""

from gyms.reply_schema import ReplySchema, one_of, text

JUDGMENTS = ("Yes", "No")
CORRECT = "Yes"  # the one judgment that makes an answer correct (UserRL: exactly "Yes"; any other reads as wrong)

JUDGE = ReplySchema(
    "search_judge",
    {"reasoning": text(), "judgment": one_of(JUDGMENTS), "feedback": text()},
    needs=("reasoning", "judgment", "feedback"),
)
