"""Wrappers installed on a library fbmt integrates with once that library's module is imported, never by
importing it (transformers' Trainer and accelerate take seconds to import, and a job may use neither)."""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from collections.abc import Callable
from typing import Any


class _OnImport(importlib.abc.MetaPathFinder):
    """Runs `install` once module `name` has been executed."""

    def __init__(self, name: str, install: Callable[[], None]):
        self.name, self.install = name, install

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != self.name:
            return None
        sys.meta_path.remove(self)  # once: the finders after it find the module
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run, install = spec.loader.exec_module, self.install

        def exec_module(module: Any) -> None:
            run(module)
            install()

        spec.loader.exec_module = exec_module
        return spec


def after_import(name: str, install: Callable[[], None]) -> None:
    """`install()` now where module `name` is imported, else right after it is."""
    if name in sys.modules:
        install()
    elif not any(isinstance(f, _OnImport) and f.name == name for f in sys.meta_path):
        sys.meta_path.insert(0, _OnImport(name, install))
