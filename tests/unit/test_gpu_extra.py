"""The `gpu` extra pins Transformer Engine to the release megatron-core's own lock pairs with the pinned
megatron-core: an unpinned TE resolves to whatever is newest, which megatron-core 0.19 was never run against."""

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# megatron-core's release branch core_r0.19.0 pins TE at git rev 4329ff84 and declares it as 2.17.1
# (pyproject.toml [tool.uv.dependency-metadata] and uv.lock: "2.17.1+4329ff84"); PyPI has 2.17.1.
TE_FOR_MCORE = {"0.19.2": "2.17.1"}


def _extras() -> dict[str, list[str]]:
    """`extras_require` of setup.py, read without running it."""
    for node in ast.walk(ast.parse((REPO / "setup.py").read_text())):
        if isinstance(node, ast.keyword) and node.arg == "extras_require":
            return ast.literal_eval(node.value)
    raise AssertionError("setup.py has no extras_require")


def _mcore_pin() -> str:
    found = re.search(r"megatron-core==([0-9.]+)", (REPO / "tools" / "install_venv.sh").read_text())
    assert found, "tools/install_venv.sh pins no megatron-core"
    return found.group(1)


def test_the_gpu_extra_pins_the_transformer_engine_megatron_core_was_released_with() -> None:
    te = [r for r in _extras()["gpu"] if r.startswith("transformer-engine")]
    assert te == [f"transformer-engine[core_cu13,pytorch]=={TE_FOR_MCORE[_mcore_pin()]}"]
