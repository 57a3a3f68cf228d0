"""TurtleGym's simulator calls and the JSON object each answers with (`gyms/reply_schema.py`)."""

from gyms.reply_schema import ReplySchema, objects, one_of, text

ANSWERS = ("Yes", "No", "Maybe")  # the judge's answer to a question, shown to the agent as it wrote it
JUDGMENTS = (0.0, 0.5, 1.0)  # a rubric statement's grade: missed, partly covered, covered

QUESTION = ReplySchema("turtle_question", {"thought": text(), "response": one_of(ANSWERS)}, needs=("response",))


def story(statements: int) -> ReplySchema:
    """The grade of a story against a rubric of `statements` statements: one graded entry per statement, in order."""
    entry = {"statement": text(), "thought": text(), "score": one_of(JUDGMENTS)}
    return ReplySchema("turtle_story", {"scores": objects(entry, statements), "feedback": text()}, needs=("scores",))
