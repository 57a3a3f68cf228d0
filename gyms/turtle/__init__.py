"""TurtleGym (LLM): uncover the hidden story behind a puzzling surface (\"turtle soup\" puzzles)."""

from gyms.turtle import env as env  # registers the gym
