"""A compile worker's process: precompile.WorkerPool runs this file as a script. It imports the kernel modules
without torch, then runs precompile.worker_main's loop.

Why without torch. A worker only compiles, with Triton, for the target the launching process recorded. But
every kernel module imports torch at its top, and so does the package `policies`. On the H200 that import is
2.8 of the ~3.7 s a round-24 worker took to its first result, and the largest part of a cold bucket's wait.

How. This script registers `policies` and `policies.fast` as bare packages, so their `__init__` modules do not
run. It serves `torch` and every `torch.*` import as a stand-in module, which answers any attribute, call,
subscript or subclassing with another stand-in. That is enough because the kernel modules' top levels only
define functions, dataclasses and constants, and no kernel body reads torch.

Checked, not assumed. Each spec carries the launching process's JITFunction cache key: a hash of the kernel's
source and of every global it reads, and part of the key of Triton's on-disk cache. When a kernel resolves to
another key here, or fails to import at all, the worker drops the stand-ins and imports everything for real
(`with_torch`), once (precompile.resolve_checked).

It runs as a script, not with `python -m policies.fast.compile_worker`, because `-m` would import the package
`policies`, and torch with it, before this file runs.
"""

import importlib.abc
import importlib.machinery
import sys
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # where `policies` imports from
BARE_PACKAGES = ("policies", "policies.fast")
STOOD_IN = "torch"


class StandIn(types.ModuleType):
    """A module, or any value read from one, that the kernel modules' top levels can use without torch.
    `torch.float8_e4m3fn`, `torch.no_grad()` and `class F(torch.autograd.Function)` all give stand-ins.
    Dunder lookups raise AttributeError, as on a real module, so that `hasattr` probes and copy/pickle
    protocols do not take a stand-in for an implementation."""

    def __init__(self, name: str):
        super().__init__(name)
        self.__path__ = []  # a package: `import torch.nn.functional` goes through the finder below

    def __getattr__(self, name: str):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return StandIn(f"{self.__name__}.{name}")

    def __call__(self, *args, **kwargs):
        return StandIn(f"{self.__name__}()")

    def __getitem__(self, key):
        return self

    def __mro_entries__(self, bases):
        return ()  # a class deriving from a stand-in derives from object


class _StandInFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves `torch` and `torch.*` imports as StandIn modules."""

    def find_spec(self, name, path=None, target=None):
        if name == STOOD_IN or name.startswith(STOOD_IN + "."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        return StandIn(spec.name)

    def exec_module(self, module):
        return None


_FINDER = _StandInFinder()


def without_torch() -> None:
    """From now on, `torch` imports give stand-ins and `policies` imports skip the packages' __init__."""
    sys.meta_path.insert(0, _FINDER)
    for name in BARE_PACKAGES:
        package = types.ModuleType(name)
        package.__path__ = [str(ROOT.joinpath(*name.split(".")))]
        sys.modules[name] = package


def with_torch() -> None:
    """Undo `without_torch`: the stand-ins, the bare packages and every module imported through them are
    dropped, so the next import of a kernel module runs for real (torch included). No-op when `without_torch`
    is not in effect (already undone, or never done)."""
    if _FINDER not in sys.meta_path:
        return
    sys.meta_path.remove(_FINDER)
    for name in [n for n in sys.modules if n.split(".")[0] in (STOOD_IN, BARE_PACKAGES[0])]:
        del sys.modules[name]


def torch_is_stood_in() -> bool:
    return isinstance(sys.modules.get(STOOD_IN), StandIn)


if __name__ == "__main__":
    sys.path[0] = str(ROOT)  # the repository root instead of this file's folder, whose modules could shadow others
    if "--with-torch" not in sys.argv[1:]:  # precompile.WORKERS_IMPORT_TORCH
        without_torch()
    from policies.fast import precompile

    precompile.worker_main(with_torch)
