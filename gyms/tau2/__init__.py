"""tau2-bench's mock, airline and retail domains, re-implemented over gyms.tau's copy-on-write databases.

Data: `<data_dir>/tau2/` (sierra-research/tau2-bench at a2c02472, MIT). See README.md for what is reproduced.
"""

from gyms.tau2 import gym as gym  # registers the conversational gyms
from gyms.tau2 import solo as solo  # registers the solo gyms
