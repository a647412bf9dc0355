"""Optional integrations with training frameworks; each module imports its framework only when
imported itself (``import dmuon_compile`` imports none of them).

- :mod:`dmuon_compile.integrations.torchtitan`: ``pip install "dmuon_compile[torchtitan]"``.
"""
