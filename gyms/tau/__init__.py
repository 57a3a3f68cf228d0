"""tau-bench retail and airline, re-implemented: domains, tools, copy-on-write databases and the tau gyms.

Importing this package registers the gyms `tau` (UserRL's TauGym), `tau_retail` and `tau_airline` (MUA-RL style).
"""

from gyms.tau import gym as gym  # registers the gyms
