"""Megatron checkpoint -> HF model directory (same as `userrl convert mcore2hf`).

python tools/convert_megatron_to_hf.py --ckpt DIR --out DIR [--tp N --pp M --ep K] [--dtype bfloat16]
"""

import sys

from userrl_megatron.cli import main

if __name__ == "__main__":  # required: the conversion spawns one process per rank
    sys.exit(main(["convert", "mcore2hf", *sys.argv[1:]]))
