"""The checkout's ``kernels/`` and ``passes/`` folders imported under their bare names.

Both folders sit at the checkout's root and are installed as ``dmuon_compile.kernels`` and
``dmuon_compile.passes`` (pyproject's ``package-dir``). With the root on ``sys.path`` (``python
-c`` or ``python -m pytest`` run there), ``import kernels`` would find ``kernels/__init__.py``
before the installed package of that name: HF's ``kernels``, which transformers imports. So their
``__init__.py``, when imported as ``kernels`` or ``passes``, call :func:`hand_over`, which puts
the installed package of that name in place of the folder; where none is installed it leaves an
empty module (no ``__file__``, no submodules): what Python makes of a folder without
``__init__.py``, a PEP 420 namespace portion, which an installed regular package outranks.

Why not delete the two ``__init__.py``: setuptools' editable finder (``pip install -e .``)
then cannot import ``dmuon_compile.kernels`` at all (``ModuleNotFoundError``: it finds a
package mapped to another folder only through that folder's ``__init__.py``).

Stdlib only, and loaded by file path, never as ``kernels._bare_name``; the package's own code
never imports ``kernels`` or ``passes`` bare.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from importlib.machinery import ModuleSpec, PathFinder


def _inside(spec: ModuleSpec, folder: str) -> bool:
    places = [spec.origin] if spec.origin else []
    places += list(spec.submodule_search_locations or ())
    for place in places:
        real = os.path.realpath(place)
        if real == folder or real.startswith(folder + os.sep):
            return True
    return False


def installed_spec(name: str, folder: str) -> ModuleSpec | None:
    """The spec ``import name`` would find if the checkout's root were not on ``sys.path``."""
    folder = os.path.realpath(folder)
    root = os.path.dirname(folder)
    path = [p for p in sys.path if not (isinstance(p, str) and os.path.realpath(p or ".") == root)]
    for finder in sys.meta_path:
        if finder is PathFinder:
            spec = PathFinder.find_spec(name, path)
        else:  # editable installs' finders, pytest's assertion rewriter, ...
            find_spec = getattr(finder, "find_spec", None)
            spec = find_spec(name, None) if find_spec is not None else None
        if spec is not None and not _inside(spec, folder):
            return spec
    return None


def hand_over(name: str, init_file: str) -> None:
    """Called by ``<folder>/__init__.py`` while it is imported as ``name`` (its bare name):
    replaces it in ``sys.modules``, which the import statement then returns."""
    spec = installed_spec(name, os.path.dirname(init_file))
    if spec is None:  # none installed: an empty namespace-like module
        module = importlib.util.module_from_spec(ModuleSpec(name, None, is_package=True))
        module.__doc__ = (
            f"No package {name!r} is installed. This checkout's {name}/ folder is "
            f"dmuon_compile.{name} (import it under that name)."
        )
        sys.modules[name] = module
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        if spec.loader is not None:
            spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
