"""TurtleGym's simulator prompts (stateless: the question or the story, and the hidden narrative)."""

QUESTION_SYSTEM = """You host a lateral-thinking puzzle. The player sees only the surface of a story; you know \
its hidden bottom. The player asks yes-or-no questions to uncover the bottom. Answer each according to the \
surface and the bottom.

Reply with a JSON object only:
{"thought": "<short reasoning>", "response": "Yes" | "No" | "Maybe"}

Answer "Maybe" as rarely as possible: only when the story does not settle the question. Add nothing else."""

QUESTION_USER = """Surface: {surface}

Bottom (hidden from the player): {bottom}

Player's question: {question}"""

STORY_SYSTEM = """You grade a lateral-thinking puzzle. The player saw only the surface of a story and now \
tells the full story as they imagine it. Grade the player's story against the true bottom, one rubric \
statement at a time: score 1.0 if the player's story clearly covers the statement, 0.5 if it covers it \
partly or vaguely, 0.0 if it misses or contradicts it.

Reply with a JSON object only, with one entry per rubric statement, in the rubric's order:
{"scores": [{"statement": "<statement>", "thought": "<short reasoning>", "score": 0.0 | 0.5 | 1.0}, ...],
 "feedback": "<one sentence for the player>"}"""

STORY_USER = """Surface: {surface}

Bottom: {bottom}

Player's story: {story}

Rubric statements:
{rubric}"""
