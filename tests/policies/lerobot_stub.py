"""Load LeRobot 0.6.1's real pi05 modeling code, for parity tests against our model.

1. If `lerobot.policies.pi05.modeling_pi05` imports (the GPU machine: Python 3.12 with the
   lerobot 0.6.1 / transformers 5.5.4 wheels), use it.
2. Else, if LEROBOT_SITE names a directory holding the unpacked `lerobot` 0.6.1 and
   `transformers` 5.5.4 packages (plus huggingface_hub, tokenizers, regex, typer), load only the
   four files pi05 sampling needs (pi_gemma.py, common/flow_matching.py, common/vla_utils.py,
   pi05/modeling_pi05.py) with the rest of the `lerobot` package replaced by tiny stand-ins:
   lerobot 0.6.1 needs Python >= 3.12 syntax elsewhere, and its training/hub infrastructure is
   irrelevant to `PI05Pytorch.sample_actions`. The model code itself runs unmodified.
   Make such a directory with:
     pip install --no-deps --target DIR transformers==5.5.4 tokenizers==0.22.2 \
         "huggingface-hub>=1.5,<2" regex typer
     pip install --no-deps --ignore-requires-python --target DIR lerobot==0.6.1
3. Else return None (tests skip).
"""

from __future__ import annotations

import importlib.util
import os
import sys
import types
import typing

MODULE = "lerobot.policies.pi05.modeling_pi05"


def load_lerobot_pi05():
    if MODULE in sys.modules:
        return sys.modules[MODULE]
    try:
        import importlib

        return importlib.import_module(MODULE)
    except Exception:  # noqa: BLE001 - any failure means "not importable here"
        for name in [m for m in sys.modules if m == "lerobot" or m.startswith("lerobot.")]:
            del sys.modules[name]
    site = os.environ.get("LEROBOT_SITE")
    if not site or not os.path.isdir(os.path.join(site, "lerobot")):
        return None
    if site not in sys.path:
        sys.path.append(site)
    return _load_with_stubs(os.path.join(site, "lerobot"))


def _module(name: str, **attrs) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__path__ = []  # a package, so submodules can be registered below it
    module.__dict__.update(attrs)
    sys.modules[name] = module
    return module


def _load_file(name: str, path: str) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _load_with_stubs(root: str):
    from torch import nn

    for pkg in (
        "lerobot",
        "lerobot.utils",
        "lerobot.policies",
        "lerobot.policies.common",
        "lerobot.policies.pi05",
        "lerobot.policies.rtc",
    ):
        _module(pkg)
    _module(
        "lerobot.utils.import_utils",
        _transformers_available=True,
        require_package=lambda *a, **k: None,
    )
    _module("lerobot.utils.device_utils", get_safe_dtype=lambda dtype, device: dtype)
    _module("lerobot.configs", PreTrainedConfig=object)
    _module("lerobot.policies.pretrained", PreTrainedPolicy=nn.Module, T=typing.TypeVar("T"))
    _module("lerobot.policies.rtc.modeling_rtc", RTCProcessor=object)
    _module("lerobot.policies.pi05.configuration_pi05", DEFAULT_IMAGE_SIZE=224, PI05Config=object)
    _load_file("lerobot.utils.constants", f"{root}/utils/constants.py")
    _load_file("lerobot.policies.pi_gemma", f"{root}/policies/pi_gemma.py")
    _load_file("lerobot.policies.common.flow_matching", f"{root}/policies/common/flow_matching.py")
    _load_file("lerobot.policies.common.vla_utils", f"{root}/policies/common/vla_utils.py")
    return _load_file(MODULE, f"{root}/policies/pi05/modeling_pi05.py")
