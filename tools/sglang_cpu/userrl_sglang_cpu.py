"""CPU compatibility for the real SGLang server in .venv-sglang (run at interpreter start by the .pth file that
tools/install_sglang_venv.sh writes). This project's own code; it replaces no SGLang code.

The only piece needed at start-up: the PyPI torchvision wheel's compiled ops link CUDA libraries, so on a CPU-only
machine `torchvision.extension` fails to load them (it tolerates that), but `torchvision._meta_registrations`
then registers fake kernels for `torchvision::nms` and `torchvision::qnms` unconditionally and raises "operator
does not exist", which makes `import torchvision` (and so `import sglang`) fail. SGLang only needs torchvision's
Python-level transforms. The hook below declares those two operator schemas, without kernels, just before that
module runs when the compiled library did not load: calling them still raises, registering their fakes works.
The stand-in `sgl_kernel` package beside this file is the other piece (see its docstring).
"""

import importlib.abc
import importlib.machinery
import sys
from types import ModuleType

_TARGET = "torchvision._meta_registrations"
# The schemas of the torchvision ops whose fakes are registered without a `_has_ops()` guard (torchvision 0.28).
_SCHEMAS = {
    "nms": "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms": "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
}
_LIBRARIES: list = []  # keeps the torch.library.Library object (and so the schemas) alive


class _DeclareTorchvisionOps(importlib.abc.MetaPathFinder):
    """Runs `_declare()` once, right before `torchvision._meta_registrations` is executed."""

    def find_spec(self, fullname: str, path: object, target: object = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != _TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)  # type: ignore[arg-type]
        if spec is None or spec.loader is None:
            return spec
        original = spec.loader

        class _Loader(importlib.abc.Loader):
            def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
                return original.create_module(spec)

            def exec_module(self, module: ModuleType) -> None:
                _declare()
                original.exec_module(module)

        spec.loader = _Loader()
        return spec


def _declare() -> None:
    import torch
    import torchvision.extension

    if torchvision.extension._has_ops():
        return  # a working torchvision (a CPU or CUDA build that loaded): nothing to do
    library = torch.library.Library("torchvision", "DEF")
    for schema in _SCHEMAS.values():
        library.define(schema)
    _LIBRARIES.append(library)


sys.meta_path.insert(0, _DeclareTorchvisionOps())
