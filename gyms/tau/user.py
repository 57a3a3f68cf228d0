"""The simulated customer of a tau episode (SPEC.md §5.4, tau-bench's `llm` strategy).

The simulator role-plays the customer from the task instruction. Roles are flipped: the agent's messages are
the simulator's `user` turns and its replies are `assistant` turns. Its history starts with the agent's stock
greeting and the task's recorded opening line, so the conversation continues exactly from the first user
message the policy was shown (UserRL's TauGym generated a second, unseen opening; see gyms/tau/README.md).
"""

from typing import Any

from gyms.user_sim import OMIT, UserSimError

STOP = "###STOP###"
GREETING = "Hi! How can I help you today?"


def customer_prompt(instruction: str) -> str:
    """The simulator's system prompt for one task."""
    return (
        "You are a user interacting with an agent: you play the customer described below, talking to a "
        "customer-service agent.\n\n"
        f"Instruction: {instruction}\n\n"
        "Rules:\n"
        "- Write only the customer's next message, one line at a time.\n"
        "- Give information piece by piece, only what the agent needs for the current step; never state the "
        "whole instruction at once.\n"
        "- Do not invent anything the instruction does not say (ids, emails, addresses, preferences). If the "
        "agent asks for something you were not given, say that you do not remember or do not have it.\n"
        f"- When the goal of the instruction is reached, reply with {STOP} alone, as a message by itself.\n"
        "- Do not copy the instruction word for word; say things in your own words.\n"
        "- Stay in character as this customer for the whole conversation."
    )


class Customer:
    """One episode's customer: the simulator history plus the injected simulator client.

    Like tau-bench's, its requests carry no temperature and no token limit (the endpoint's defaults apply) unless
    `temperature` / `max_tokens` are given (`gyms.tau.customer_temperature` / `customer_max_tokens`).
    """

    def __init__(
        self,
        user_sim: Any,
        instruction: str,
        opening: str,
        temperature: float | None = None,
        max_tokens: int | None = None,
    ) -> None:
        self.user_sim = user_sim
        self.temperature = OMIT if temperature is None else temperature
        self.max_tokens = OMIT if max_tokens is None else max_tokens
        self.history: list[dict[str, str]] = [
            {"role": "system", "content": customer_prompt(instruction)},
            {"role": "user", "content": GREETING},
            {"role": "assistant", "content": opening},
        ]

    async def reply(self, message: str) -> str:
        """The customer's answer to an agent message; UserSimError (history unchanged) when the simulator fails."""
        self.history.append({"role": "user", "content": message})
        try:
            reply = await self.user_sim.chat(self.history, temperature=self.temperature, max_tokens=self.max_tokens)
        except UserSimError:
            self.history.pop()
            raise
        self.history.append({"role": "assistant", "content": reply.text})
        return reply.text
