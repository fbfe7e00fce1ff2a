"""Optional dependencies: the packages of one feature, imported where the feature starts, with an
error that names the extra to install (``import fastinfer``, the ops and ``LLM`` need none of them).
"""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["require"]


def require(module: str, extra: str, feature: str) -> ModuleType:
    """``import module``, or an ImportError saying that ``feature`` needs ``fastinfer[extra]``
    (an ImportError from inside an installed package, a broken install, propagates unchanged)."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        if e.name != module:
            raise
        raise ImportError(f"{feature} needs the '{module}' package: pip install 'fastinfer[{extra}]'") from e
