"""Which of torch's scaled-dot-product-attention kernels the actor and the embedded engine let torch choose.

Every backend but cuDNN's. torch 2.11 with cuDNN 9.19 puts cuDNN first on Hopper, and cuDNN builds an execution
graph for each new shape. Measured on an H200 (docs/gpu.md): a decode-like call whose key length grows by one
took 59 ms by default and 0.05 ms without cuDNN; a forward and backward at a new sequence length took 137 ms
against 2.9 ms. Decode steps and RL micro-batches change shape nearly every call, so the build is paid nearly
every time; flash and memory-efficient attention need no build.
"""

from torch.nn.attention import SDPBackend

SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
