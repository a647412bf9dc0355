"""Kernels for the Newton–Schulz chain, installed as ``dmuon_compile.kernels``.

``ops`` defines the project's custom ops (``torch.ops.dmuon.*``) with a torch reference
implementation for every device; the Triton kernels (``syrk``) register themselves as the CUDA
implementation when Triton is importable. A machine without Triton still imports this package
(CUDA then runs the torch reference); ``TRITON_KERNELS_IMPORT_ERROR`` says why.

Imported as the bare ``kernels`` (the checkout's root on ``sys.path``), this file defines nothing:
the installed ``kernels`` (HF's, which transformers imports) takes its place (``_bare_name.py``).

The floor of the package: no module here imports from ``dmuon_compile`` above it, except the
leaf utilities ``dmuon_compile.env`` (every ``DMUON_*`` variable), ``dmuon_compile.log`` and
``dmuon_compile._compat``, which import nothing else of the package
(``tests/test_repository.py`` checks both).
"""

if __name__ == "kernels":  # the checkout's folder under its bare name: not this package
    import importlib.util as _util
    import os as _os

    _spec = _util.spec_from_file_location(
        "_dmuon_bare_name", _os.path.join(_os.path.dirname(__file__), "_bare_name.py")
    )
    _bare = _util.module_from_spec(_spec)
    _spec.loader.exec_module(_bare)
    _bare.hand_over(__name__, __file__)
else:
    from dmuon_compile.kernels import ops  # noqa: F401  (registers torch.ops.dmuon.*)
    from dmuon_compile.kernels.availability import triton_status
    from dmuon_compile.kernels.consistency import agree_across_ranks, check_ns_backend_consistent

    try:
        from dmuon_compile.kernels import syrk  # noqa: F401  (registers the CUDA kernels)

        TRITON_KERNELS_IMPORT_ERROR: str | None = None
    except ImportError as _exc:  # pragma: no cover - depends on the environment
        TRITON_KERNELS_IMPORT_ERROR = f"{type(_exc).__name__}: {_exc}"

    __all__ = [
        "ops",
        "triton_status",
        "agree_across_ranks",
        "check_ns_backend_consistent",
        "TRITON_KERNELS_IMPORT_ERROR",
    ]
