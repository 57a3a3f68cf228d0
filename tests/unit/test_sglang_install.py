"""The SGLang interpreter `make sglang` builds (.venv-sglang): the pinned versions, and this project's CPU
compatibility pieces (tools/sglang_cpu) doing exactly what their comments say."""

import subprocess

import pytest

from userrl_megatron.fleet.sglang import SGLANG_VENV_PYTHON, sglang_env

CHECK = """
import importlib.metadata as md, torch, torchvision, sgl_kernel
from sgl_kernel.mamba import chunk_gated_delta_rule_cpu
print(md.version("sglang"), md.version("sglang-router"), torch.__version__, torchvision.extension._has_ops())
print(sgl_kernel.STANDIN, hasattr(torch.ops.sgl_kernel, "convert_weight_packed"))
try:
    sgl_kernel.copy_all_layer_kv_cache_cpu()
except NotImplementedError as e:
    print(e)
from sglang.kernels.ops.kvcache import cache_move  # imports sgl_kernel names at module level on CPU
print(cache_move.copy_all_layer_kv_cache_cpu is sgl_kernel.copy_all_layer_kv_cache_cpu)
"""


def test_sglang_venv_imports_on_cpu() -> None:
    if not SGLANG_VENV_PYTHON.is_file():
        pytest.fail(f"{SGLANG_VENV_PYTHON} is missing: run `make sglang` (make test does it)")
    out = subprocess.run(
        [str(SGLANG_VENV_PYTHON), "-c", CHECK],
        capture_output=True,
        text=True,
        timeout=600,
        env={"PATH": "/usr/bin:/bin", **sglang_env("cpu")},
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        "0.5.23 0.3.2 2.13.0+cpu False",  # torchvision imports although its CUDA-linked ops cannot load
        "True False",  # the stand-in, registering no ops: SGLang's AMX backend stays off
        "sgl_kernel.copy_all_layer_kv_cache_cpu is a stand-in (tools/sglang_cpu): SGLang called a CPU kernel "
        "this install lacks",
        "True",
    ]
