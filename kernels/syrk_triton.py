"""The two names the README's kernel section imports from here, kept importable by that path.

The kernels live one family per file: ``symmetric_product.py`` (the launcher),
``lower_tiles.py`` (``TileConfig``, schedule, epilogue), ``syrk_pointer.py``, ``syrk_tma.py``
and ``mirror.py``. New code imports from those modules.
"""

from dmuon_compile.kernels.lower_tiles import TileConfig
from dmuon_compile.kernels.symmetric_product import launch_symmetric_product

__all__ = ["TileConfig", "launch_symmetric_product"]
