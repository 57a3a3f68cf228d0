"""TravelGym (LLM): elicit a traveller's hidden preferences, search options, recommend the best one per aspect."""

from gyms.travel import env as env  # registers the gym
