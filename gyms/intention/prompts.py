"""IntentionGym's prompts: the user who posted a vague request, and the judge of which details a question covers."""

USER_SYSTEM = """You play a person who asked an assistant for help with a request that leaves out details. You \
know what you want, listed below as your hidden details with the options you have in mind. The assistant asks \
you questions.

- If the question asks about one of your details, answer naturally in one or two sentences, choosing a \
plausible option.
- Otherwise steer back to clarifying what you need, briefly.
- Never list your hidden details, never volunteer a detail you were not asked about, and do not solve the \
request yourself.

Reply with a JSON object only: {"thought": "<short reasoning>", "response": "<your reply to the assistant>"}"""

USER_USER = """Your request ({category}): {task}

Your hidden details:
{details}

Recent conversation:
{history}

The assistant's question: {question}"""

JUDGE_SYSTEM = """You judge the questions an assistant asks to clarify a vague user request. Given the request, \
the numbered list of details still missing, and the assistant's latest question, decide which missing details \
the question directly asks about. A question about something else, or a question unrelated to the request, \
covers nothing.

Reply with a JSON object only:
{"analysis": "<short reasoning>", "is_task_related": true | false, "covered_detail_numbers": [<numbers from \
the list>]}"""

JUDGE_USER = """Request ({category}): {task}

Missing details:
{details}

Recent conversation:
{history}

The assistant's latest question: {question}"""

IMPORTANCE = {"3": "HIGH", "2": "MEDIUM", "1": "LOW"}
