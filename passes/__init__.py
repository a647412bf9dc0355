"""Compiler passes of dmuon_compile (installed as ``dmuon_compile.passes``).

- :class:`NSChainPass` — the Inductor ``post_grad_custom_pre_pass`` that rewrites the
  Newton–Schulz chain into ``torch.ops.dmuon.syrk`` / ``sym_mm`` (``ns_rewrite``), guided by
  the symmetry-provenance analysis (``symmetry``) and checked with sympy (``polynomial``).
- :func:`compile_options` / :func:`wrap_pass` / :func:`install_global_pass` — install it
  without overwriting a pass the user already configured.
- Importing this package registers the ``dmuon`` ``TORCH_LOGS`` name (``TORCH_LOGS="+dmuon"``).

Example::

    >>> from dmuon_compile.passes import compile_options
    >>> fn = torch.compile(step, fullgraph=True, options=compile_options())  # doctest: +SKIP

Imported as the bare ``passes`` (the checkout's root on ``sys.path``), this file defines nothing:
an installed ``passes``, if any, takes its place (``kernels/_bare_name.py``).
"""

if __name__ == "passes":  # the checkout's folder under its bare name: not this package
    import importlib.util as _util
    import os as _os

    _spec = _util.spec_from_file_location(
        "_dmuon_bare_name",
        _os.path.join(_os.path.dirname(_os.path.dirname(__file__)), "kernels", "_bare_name.py"),
    )
    _bare = _util.module_from_spec(_spec)
    _spec.loader.exec_module(_bare)
    _bare.hand_over(__name__, __file__)
else:
    from dmuon_compile.passes.kernel_source import kernel_sources, register_kernel_source
    from dmuon_compile.passes.manager import (
        NSChainPass,
        compile_options,
        install_global_pass,
        wrap_pass,
    )
    from dmuon_compile.passes.ns_rewrite import SUBPASSES, RewriteStats, rewrite_ns_chain
    from dmuon_compile.passes.symmetry import IDENTITY, SymmetryAnalysis

    from dmuon_compile import kernels as _kernels  # noqa: F401  (registers torch.ops.dmuon.*)
    from dmuon_compile.log import register_torch_logs

    register_torch_logs()

    __all__ = [
        "IDENTITY",
        "SUBPASSES",
        "NSChainPass",
        "RewriteStats",
        "SymmetryAnalysis",
        "compile_options",
        "install_global_pass",
        "kernel_sources",
        "register_kernel_source",
        "rewrite_ns_chain",
        "wrap_pass",
    ]
