"""Import stub standing in for torchvision in kvtier's SGLang CPU harness (``make test-sglang``).

sglang 0.5.23 imports torchvision at module level in its multimodal helpers
(``srt/multimodal/internvl_utils.py:5``) and transformers imports parts of it once it is
importable; the host pools, storage factory and plugin loader that the harness drives never use
it. PyPI's torchvision is a CUDA build, so this package answers every ``torchvision.*`` import
with an empty module whose attributes are placeholder classes that cannot be instantiated. It
must never be on the path of anything but the harness venv (its ``.pth`` file puts it there).
"""

import importlib.abc
import importlib.machinery
import sys
import types

__version__ = "0.0.0+kvtier.harness.stub"


class _StubMeta(type):
    def __getattr__(cls, name):
        return _stub_attr(name)


class _Unavailable(metaclass=_StubMeta):
    def __init__(self, *args, **kwargs):
        raise RuntimeError(f"{type(self).__name__}: torchvision is a stub in kvtier's sglang harness")


def _stub_attr(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return _StubMeta(name, (_Unavailable,), {})


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith(__name__ + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__getattr__ = _stub_attr
        return module

    def exec_module(self, module):
        pass


sys.meta_path.append(_StubFinder())
__getattr__ = _stub_attr
