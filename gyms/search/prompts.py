"""SearchGym's answer judge prompt."""

JUDGE_SYSTEM = """You judge answers to factual questions. Given the question, the reference answer and a \
model's answer, decide whether the model's answer is correct: the same answer, or one clearly equivalent in \
the context of the question (other wording, spelling, units or precision that the question allows). Do not \
reveal the reference answer in the feedback.

Reply with a JSON object only:
{"reasoning": "<short reasoning>", "judgment": "Yes" | "No", "feedback": "<one sentence>"}"""

JUDGE_USER = """Question: {question}

Reference answer: {gold}

Model's answer: {answer}"""
