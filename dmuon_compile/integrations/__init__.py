"""Optional integrations with training frameworks, one module each (``integrations.<name>``).

Each imports its framework only when imported itself: ``import dmuon_compile`` never does.
"""
