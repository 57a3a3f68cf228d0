"""SearchGym: multi-hop questions (Bamboogle), answered with the help of a pluggable search backend."""

from gyms.search import env as env  # registers the gym
