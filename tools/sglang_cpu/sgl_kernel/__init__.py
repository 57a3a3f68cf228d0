"""Stand-in for SGLang's CPU kernel package `sgl_kernel`, for .venv-sglang on machines where it cannot be installed.

Why: with SGLANG_USE_CPU_ENGINE=1, SGLang 0.5.23 imports a few names from `sgl_kernel` at module level (e.g.
`sglang/kernels/ops/kvcache/cache_move.py`), so the server cannot even start without the package. Its CPU build
exists only as source inside the SGLang repository, and the PyPI `sgl-kernel` wheel is CUDA-only (it fails to
import: libnvrtc.so.12). On a CPU without AMX SGLang takes its `torch_native` paths and never calls these
functions for the models served here; every name below raises if it is ever called, so nothing is silently faked.
It registers no `torch.ops.sgl_kernel` ops, so SGLang's AMX detection stays off. The directory of this package
is appended to sys.path by a .pth file: a real `sgl_kernel` installed in site-packages (GPU nodes) comes first.
"""

from collections.abc import Callable
from typing import Any

STANDIN = True  # lets a test tell this package from the real one


def _missing(name: str) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            f"sgl_kernel.{name} is a stand-in (tools/sglang_cpu): SGLang called a CPU kernel this install lacks"
        )

    call.__name__ = name
    return call


# Imported at module level when SGLANG_USE_CPU_ENGINE=1 (found by scanning sglang 0.5.23 for `if _is_cpu:` imports).
copy_all_layer_kv_cache_cpu = _missing("copy_all_layer_kv_cache_cpu")  # mem_cache/memory_pool via cache_move
assign_req_to_token_pool_cpu = _missing("assign_req_to_token_pool_cpu")  # mem_cache/allocation
rotate_input_ids_cpu = _missing("rotate_input_ids_cpu")  # speculative decoding (unused here)
fill_accept_out_cache_loc_cpu = _missing("fill_accept_out_cache_loc_cpu")  # speculative decoding
fill_bonus_tokens_cpu = _missing("fill_bonus_tokens_cpu")  # speculative decoding
assign_draft_cache_locs_contiguous_cpu = _missing("assign_draft_cache_locs_contiguous_cpu")  # speculative decoding
assign_extend_cache_locs_cpu = _missing("assign_extend_cache_locs_cpu")  # speculative decoding
build_tree_kernel_efficient_cpu = _missing("build_tree_kernel_efficient_cpu")  # speculative decoding
verify_tree_greedy_cpu = _missing("verify_tree_greedy_cpu")  # speculative decoding
