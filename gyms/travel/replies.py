"""TravelGym's simulator calls and the JSON object each answers with (`gyms/reply_schema.py`)."""

from gyms.reply_schema import ReplySchema, one_of, text
from gyms.travel.catalog import ASPECT_INITIALS

# The search judge's verdict; any other value fails the judge (UserRL). "N/A": a request unrelated to the trip.
VERDICTS = ("True", "False", "N/A")
ASPECTS = (*ASPECT_INITIALS, "")  # the aspect a "True" verdict names ("" otherwise)
# The utterance judge's type: 1 small talk, 2 a question about a listed preference, 3 about an unlisted one, 4 vague.
UTTERANCE_TYPES = ("1", "2", "3", "4")

SEARCH_JUDGE = ReplySchema(
    "travel_search_judge",
    {"alignment_judgement": one_of(VERDICTS), "alignment_aspect": one_of(ASPECTS)},
    needs=("alignment_judgement",),
)
UTTERANCE_JUDGE = ReplySchema(
    "travel_utterance_judge", {"type": one_of(UTTERANCE_TYPES), "preference_id": text()}, needs=("type",)
)
TRAVELLER = ReplySchema("travel_traveller", {"thought": text(), "response": text()}, needs=("response",))
