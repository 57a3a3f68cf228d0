"""userrl_megatron: multi-turn, user-centric RL with Megatron-core actors and SGLang rollout engines."""
