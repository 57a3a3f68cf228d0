"""userrl_megatron: multi-turn, user-centric RL with Megatron-core actors and SGLang rollout engines."""

from userrl_megatron.config.gyms import add_gym_finder


def _find_gyms() -> None:
    """Register every gym, built-in and installed (`gyms.catalog`), so that the config types each one's section."""
    from gyms.catalog import find_gyms

    find_gyms()


add_gym_finder(_find_gyms)
