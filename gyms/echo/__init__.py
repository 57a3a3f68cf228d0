"""EchoGym (deterministic, toy): say the requested letter, turn after turn. For smoke and learning tests."""

from gyms.echo import env as env  # registers the gym
