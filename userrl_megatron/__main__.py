"""`python -m userrl_megatron` runs the `userrl` command line."""

import sys

from userrl_megatron.cli import main

sys.exit(main())
