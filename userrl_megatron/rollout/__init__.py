"""Rollout: multi-turn episodes in token space, engine servers and their client, the Ray engine pool."""
