"""Multi-turn SFT on the Megatron actor, tokenised by rollout/chat.py exactly like rollouts (docs/sft.md)."""
