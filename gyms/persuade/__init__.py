"""PersuadeGym (LLM): argue a persona out of a claim it strongly agrees with."""

from gyms.persuade import env as env  # registers the gym
