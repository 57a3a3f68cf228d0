"""Rollout: multi-turn episodes in token space against the engines (the agent loop), their statistics."""
