"""PersuadeGym's simulator call and the JSON object it answers with (`gyms/reply_schema.py`)."""

from gyms.reply_schema import ReplySchema, one_of, text

# The persona's stances, from the claim's side to the other; a reply must spell one exactly (UserRL's list.index).
STANCES = (
    "Strongly Agree",
    "Agree",
    "Partly Agree",
    "Neutral",
    "Partly Disagree",
    "Disagree",
    "Strongly Disagree",
)

PERSONA = ReplySchema(
    "persuade_persona",
    {"thought": text(), "response": text(), "stance": one_of(STANCES)},
    needs=("response", "stance"),
)
