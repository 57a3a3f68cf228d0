"""FunctionGym (deterministic): guess a hidden arithmetic rule, then answer its test case."""

from gyms.function import env as env  # registers the gym
