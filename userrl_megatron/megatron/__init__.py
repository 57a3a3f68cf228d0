"""The only package that imports megatron.core (and Transformer Engine, on GPU).

Importing the package does nothing: the modules that use megatron.core import it themselves. Without triton (CPU
installs) `import megatron.core` fails unless `cpu.stub_missing_kernels()` ran first in the process; the places
that start Megatron code call it explicitly (an actor rank's `MegatronWorker.setup`, each rank of
`launch.run_local`, the driver's `ActorGroup`), and on CPU `parallel.initialize` (`cpu.install`) redirects
Megatron's CUDA calls to the CPU. Modules:

  cpu.py         CPU support (gloo, no CUDA): the few CUDA assumptions redirected to the CPU
  parallel.py    process setup: torch.distributed + Megatron's parallel groups; layout checks
  model.py       GPTModel chunks from an HF config (TE or local spec; dense or MoE), weight loading
  attention.py   torch SDPA core attention for the local spec
  packing.py     data-parallel balancing, token-budget micro-batches, padded / packed (THD) inputs
  logits.py      vocab-parallel log-probs and entropy
  optimizer.py   DDP, distributed AdamW, LR schedule, offload
  actor.py       MegatronActor: compute_logprobs, train_step, export_hf_weights, save/load, offload
  export.py      full HF-named tensors from the sharded model, experts gathered over EP (weight sync, HF export)
  checkpoint.py  distributed checkpoints (resharding on load); the folders on disk are `run/checkpoint_files.py`'s
  checkpoint_writer.py  runs a save's writes inline or on a thread from host staging buffers
  offload.py     offload/onload of weights, grads and optimizer state; what each operation needs resident
  reference.py   the reference policy's weights in host memory, swapped in for the KL term
  conversion.py  hf2mcore / mcore2hf converters
  launch.py      run a function on N local ranks (spawned processes)
"""
