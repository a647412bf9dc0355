"""``NSChainPass``: the Inductor ``post_grad_custom_pre_pass`` that runs the NS-chain sub-passes.

Install it per compiled function (what ``dmuon_compile.compiled_step`` does)::

    fn = torch.compile(step, fullgraph=True, options=compile_options())

``compile_options()`` wraps whatever ``torch._inductor.config.post_grad_custom_pre_pass`` the
user already set: their pass runs first, on the graph it would have seen without us, then
ours. ``install_global_pass()`` does the same wrapping on the global config (used when a user
compiles ``opt.step`` themselves, see ``compiled_step.py``).

The pass has a stable :meth:`NSChainPass.uuid` (a hash of the pass and kernel sources, the
flags and the wrapped pass's uuid), so Inductor's FX graph cache stays on; a cache hit then
skips the pass — tests that assert it ran disable caches.

Inductor's internals (``CustomGraphPass``, ``get_hash_for_files``, the global config) are read
through ``dmuon_compile/_compat.py``; ``DMUON_NS_KERNEL`` through ``dmuon_compile/env.py``.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from dmuon_compile.passes.ns_rewrite import SUBPASSES, RewriteStats, rewrite_ns_chain

from dmuon_compile import env
from dmuon_compile._compat import (
    custom_graph_pass_base,
    hash_for_files,
    post_grad_custom_pre_pass,
    set_post_grad_custom_pre_pass,
)

log = logging.getLogger("dmuon_compile.passes")

# Bump when the pass changes behaviour without its source files changing (e.g. a new flag
# default read from elsewhere); part of the uuid.
PASS_VERSION = "1"
_PASS_DIR = Path(__file__).resolve().parent


def _kernel_dir() -> Path:
    from dmuon_compile import kernels

    return Path(kernels.__file__).resolve().parent


def _size_gate() -> tuple[int, ...]:
    """The size gate the pass applies (it lives outside the hashed sources): a graph cached
    under another gate must not be reused."""
    from dmuon_compile import kernel_choice as k

    return (
        k.TRITON_MIN_ROWS,
        k.TRITON_MIN_ROWS_BATCHED,
        k.TRITON_MIN_BATCH,
        k.TRITON_MIN_ROWS_LARGE_STACK,
        k.TRITON_MIN_BATCH_LARGE_STACK,
    )


def _source_files() -> tuple[str, ...]:
    files = sorted(_PASS_DIR.glob("*.py")) + sorted(_kernel_dir().rglob("*.py"))
    return tuple(str(f) for f in files)


class NSChainPass(custom_graph_pass_base()):
    """Rewrite the Newton–Schulz chain of a post-grad graph into ``torch.ops.dmuon`` kernels.

    Args:
        user_pass: a pass that was already installed (``CustomGraphPass`` or a plain callable);
            it runs first, unchanged. A plain callable has no uuid, which makes this pass's
            uuid ``None`` too (Inductor then bypasses its FX graph cache, as it would for the
            user's pass alone).
        subpasses: names of the sub-passes to run (default: all of ``ns_rewrite.SUBPASSES``).
        prove: check every symmetric-product rewrite with sympy (default True).

    After each run, ``last_stats`` holds a :class:`~dmuon_compile.passes.ns_rewrite.RewriteStats`
    and ``torch._dynamo.utils.counters["dmuon"]`` the running totals.

    Example::

        >>> from dmuon_compile.passes import NSChainPass
        >>> options = {"post_grad_custom_pre_pass": NSChainPass()}
        >>> f = torch.compile(ns, fullgraph=True, options=options)  # doctest: +SKIP
    """

    def __init__(self, user_pass=None, *, subpasses=tuple(SUBPASSES), prove: bool = True) -> None:
        if isinstance(user_pass, NSChainPass):
            raise ValueError(  # noqa: TRY004 - the type is fine, the nesting is the error
                "NSChainPass(user_pass=NSChainPass(...)) would run the rewrite twice; "
                "use wrap_pass(), which returns an existing NSChainPass unchanged"
            )
        if user_pass is not None and not callable(user_pass):
            raise TypeError(
                f"user_pass must be callable (a CustomGraphPass), got {type(user_pass).__name__}"
            )
        unknown = set(subpasses) - set(SUBPASSES)
        if unknown:
            raise ValueError(
                f"unknown dmuon sub-pass(es) {sorted(unknown)}; choose from {sorted(SUBPASSES)}"
            )
        self.user_pass = user_pass
        self.subpasses = tuple(name for name in SUBPASSES if name in subpasses)
        self.prove = bool(prove)
        self.last_stats: RewriteStats | None = None

    def __call__(self, graph: torch.fx.Graph) -> None:
        if self.user_pass is not None:
            self.user_pass(graph)
        stats = rewrite_ns_chain(graph, self.subpasses, self.prove)
        self.last_stats = stats
        made = sum(stats.rewrites.values())
        if made or stats.skipped:
            saved = stats.flops_before - stats.flops_after
            log.info(
                "NS-chain pass: %d rewrite(s) %s, %d candidate(s) skipped, %d sympy proof(s); "
                "symmetric kernels do %.3g of %.3g MFLOP (saves %.3g MFLOP)",
                made,
                dict(stats.rewrites),
                len(stats.skipped),
                stats.proved,
                stats.flops_after / 1e6,
                stats.flops_before / 1e6,
                saved / 1e6,
            )
        if stats.ops_inserted and log.isEnabledFor(logging.DEBUG):
            from dmuon_compile.passes.kernel_source import log_kernel_sources

            log_kernel_sources(graph, stats.ops_inserted)

    def uuid(self):
        user_uuid = ""
        if self.user_pass is not None:
            get = getattr(self.user_pass, "uuid", None)
            user_uuid = get() if callable(get) else None
            if user_uuid is None:
                return None
        extra = "|".join(
            [
                f"pass={PASS_VERSION}",
                f"subpasses={','.join(self.subpasses)}",
                f"prove={self.prove}",
                f"user={user_uuid!r}",
                f"kernel_env={env.ns_kernel_setting()}",
                f"size_gate={_size_gate()}",
            ]
        )
        return hash_for_files(_source_files(), extra).hex()

    def __repr__(self) -> str:
        return f"NSChainPass(user_pass={self.user_pass!r}, subpasses={self.subpasses})"


def wrap_pass(existing=None, **kwargs) -> NSChainPass:
    """``existing`` wrapped in an :class:`NSChainPass` (returned as is if it already is one).

    >>> wrap_pass(None)
    NSChainPass(user_pass=None, subpasses=('syrk', 'sym_mm', 'fold_identity', 'fold_epilogue'))
    """
    if isinstance(existing, NSChainPass):
        return existing
    return NSChainPass(existing, **kwargs)


def compile_options(extra: dict | None = None, **kwargs) -> dict:
    """``torch.compile(options=...)`` with the NS pass wrapping the currently configured one.

    >>> sorted(compile_options())
    ['post_grad_custom_pre_pass']
    """
    options = dict(extra or {})
    current = options.get("post_grad_custom_pre_pass", post_grad_custom_pre_pass())
    options["post_grad_custom_pre_pass"] = wrap_pass(current, **kwargs)
    return options


def install_global_pass() -> NSChainPass:
    """Wrap ``torch._inductor.config.post_grad_custom_pre_pass`` in place (idempotent).

    Used when the graph is compiled by someone else's ``torch.compile`` (``opt.step =
    torch.compile(opt.step)``): Inductor reads the global config at compile time. A pass the
    user set later replaces ours; an explicit ``options={"post_grad_custom_pre_pass": ...}``
    on their ``torch.compile`` wins over the global one (wrap it with ``wrap_pass``).

    >>> p = install_global_pass(); install_global_pass() is p
    True
    """
    current = post_grad_custom_pre_pass()
    if isinstance(current, NSChainPass):
        return current
    wrapped = wrap_pass(current)
    set_post_grad_custom_pre_pass(wrapped)
    log.info(
        "installed the dmuon NS-chain pass as torch._inductor.config.post_grad_custom_pre_pass"
        " (wrapping %r)",
        current,
    )
    return wrapped
