"""TelepathyGym's simulator calls and the JSON object each answers with (`gyms/reply_schema.py`)."""

from gyms.reply_schema import ReplySchema, one_of, text

ANSWERS = ("Yes", "No", "Maybe")  # the judge's answer to a question, shown to the agent as it wrote it
JUDGMENTS = ("Yes", "No")  # the judge's verdict on a guess
CORRECT = "Yes"  # the one verdict that makes a guess correct (UserRL: exactly "Yes"; any other reads as wrong)

QUESTION = ReplySchema("telepathy_question", {"thought": text(), "response": one_of(ANSWERS)}, needs=("response",))
GUESS = ReplySchema(
    "telepathy_guess",
    {"thought": text(), "judgment": one_of(JUDGMENTS), "feedback": text()},
    needs=("judgment", "feedback"),
)
