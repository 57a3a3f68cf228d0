"""TelepathyGym (LLM): guess the entity the environment thinks of, by yes/no questions."""

from gyms.telepathy import env as env  # registers the gym
