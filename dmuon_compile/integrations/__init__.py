"""Optional integrations with training frameworks, one module each (``integrations.<name>``).

Each imports its framework only when imported itself: ``import dmuon_compile`` never does.

- :mod:`dmuon_compile.integrations.torchtitan`: ``pip install "dmuon_compile[torchtitan]"``.
- :mod:`dmuon_compile.integrations.accelerate`: ``pip install "dmuon_compile[accelerate]"``.
"""
