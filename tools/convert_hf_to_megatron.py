"""HF model directory -> Megatron distributed checkpoint (same as `userrl convert hf2mcore`).

python tools/convert_hf_to_megatron.py --hf DIR --out DIR --tp N --pp M [--ep K] [--dtype bfloat16]
"""

import sys

from userrl_megatron.cli import main

if __name__ == "__main__":  # required: the conversion spawns one process per rank
    sys.exit(main(["convert", "hf2mcore", *sys.argv[1:]]))
