"""IntentionGym (LLM): clarify a vague request by asking about its missing details."""

from gyms.intention import env as env  # registers the gym
