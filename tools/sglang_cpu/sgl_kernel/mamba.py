"""Stand-in names of `sgl_kernel.mamba` imported by SGLang's linear-attention modules on CPU (see the package)."""

from sgl_kernel import _missing

causal_conv1d_update_cpu = _missing("causal_conv1d_update_cpu")  # layers/attention/linear/kda_backend
chunk_gated_delta_rule_cpu = _missing("chunk_gated_delta_rule_cpu")  # layers/attention/linear/kernels/gdn_triton
