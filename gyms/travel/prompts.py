"""TravelGym's simulator prompts: the search judge, the utterance judge and the traveller's three reply modes."""

SEARCH_JUDGE_SYSTEM = """You check search requests sent to a travel database. The trip has one set of \
ground-truth search arguments per travel aspect. A request is aligned with an aspect only if it is one single \
request for that aspect that states every one of its arguments correctly (wording may differ). Missing, wrong \
or extra-aspect arguments, several requests at once, or an unclear request are not aligned.

Reply with a JSON object only:
{"alignment_judgement": "True" | "False", "alignment_aspect": "flight" | "hotel" | "apartment" | \
"restaurant" | "rental_car" | ""}
(the aspect is required when the judgement is "True")."""

SEARCH_JUDGE_USER = """Search request: {request}

Ground-truth search arguments:
{arguments}"""

UTTERANCE_JUDGE_SYSTEM = """You classify what a travel agent just said to a traveller, given the traveller's \
hidden preferences that the agent has not uncovered yet:
- type "1": ordinary conversation, not asking about a preference;
- type "2": a concrete, specific question about one of the listed preferences (e.g. "Which airline do you \
prefer?" or "Do you need a pool?"); give that preference's id;
- type "3": a concrete, specific question about a preference that is not in the list;
- type "4": a vague, general question about preferences (e.g. "Any preferences for the hotel?").

Reply with a JSON object only: {"type": "1" | "2" | "3" | "4", "preference_id": "<id if type 2, else empty>"}"""

UTTERANCE_JUDGE_USER = """Trip: {scenario}

Conversation so far:
{history}

Agent's latest utterance: {utterance}

Hidden preferences not yet uncovered:
{preferences}"""

REVEAL_SYSTEM = """You are a traveller talking with a travel agent. The agent just asked about something you \
care about. Answer naturally, revealing your preference indirectly, as a real person would, inspired by the \
hint below. Do not state it as a rule ("my preference is ..."), and do not mention other preferences.

Reply with a JSON object only: {"thought": "<short reasoning>", "response": "<your reply>"}"""

ELICIT_SYSTEM = """You are a traveller talking with a travel agent who has not asked about what matters to \
you for a while. In your reply, steer the conversation naturally toward the preference below and hint at it \
indirectly, inspired by the hint. Name the travel aspect (flight, hotel, ...) it is about if the hint leaves \
it unclear.

Reply with a JSON object only: {"thought": "<short reasoning>", "response": "<your reply>"}"""

PREFERENCE_USER = """Your preference ({aspect}): {preference}
Hint of how you express it: {implicit}

Conversation so far:
{history}

Agent's latest utterance: {utterance}"""

NATURAL_SYSTEM = """You are a traveller talking with a travel agent. Reply briefly and naturally, a little \
half-heartedly, without asking questions and without revealing any preference (if asked, say you have no \
particular preference).

Reply with a JSON object only: {"thought": "<short reasoning>", "response": "<your reply>"}"""

NATURAL_USER = """Conversation so far:
{history}

Agent's latest utterance: {utterance}"""
