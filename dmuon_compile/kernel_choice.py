"""Triton SYRK kernels, quack's or plain cuBLAS: the one function that decides, for every caller.

Eager Newton–Schulz (``NewtonSchulz.primitives_for``), the compiled step (whether it runs the
NS-chain pass: ``compiled_step.pass_enabled``), the pass itself (which products it leaves on
cuBLAS: ``passes.ns_rewrite.below_size_gate``) all call :func:`choose_kernel`; its docstring
holds every rule. The ops' untimed fallback when autotune does not time (rule 2) is decided
inside the kernel package, which imports nothing above it: ``kernels.autotune.untimed_choice``
holds that rule, and :func:`choose_kernel` (``site="op"``) asks it. No other module compares
sizes, dtypes or kernel names to pick a path.

Whether every rank resolved the same kernel is checked beside the backend's description
(``newton_schulz.check_ns_backend_consistent``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dmuon_compile.kernels.autotune import (  # noqa: F401  (UNTIMED_MIN_ROWS: re-exported)
    HALF_DTYPES,
    UNTIMED_MIN_ROWS,
    untimed_choice,
)

# Size gate of the Newton–Schulz products (m×m outputs, a stack of ``batch``): below it the
# symmetric kernels lose to cuBLAS. Expert stacks pass it: stacks of 1536-row matrices, and of
# 768-row ones when the stack is large (a step's bucket of expert stacks); there the Gluon and
# TMA kernels beat cuBLAS's full product, which also copies C into its output before every
# product with a beta·C term. Stacks of 32 768-row matrices pass since the plain X·Xᵀ has the
# Gluon ping-pong (benchmarks/RESULTS.md §27, §29; before it they lost, §22); stacks of 16 still
# lose. The autotune keeps cuBLAS per shape where it wins, at the cost of a mirror pass.
TRITON_MIN_ROWS = 4096
TRITON_MIN_ROWS_BATCHED = 1536
TRITON_MIN_BATCH = 8
TRITON_MIN_ROWS_LARGE_STACK = 768
TRITON_MIN_BATCH_LARGE_STACK = 32
# The op's untimed fallback (UNTIMED_MIN_ROWS, HALF_DTYPES) is the kernel package's rule,
# kernels/autotune.py, imported above under the same names.
# kernel="quack": products with fewer output rows than one of quack's symmetric tiles run cuBLAS
# (the threshold Dao-AILab's gram-newton-schulz uses with the same kernel).
QUACK_MIN_ROWS = 256

SITES = ("eager", "step", "graph", "op")
TRITON, CUBLAS, REFERENCE, QUACK = "triton", "cublas", "reference", "quack"


@dataclass(frozen=True)
class KernelChoice:
    """What runs a symmetric product: ``"triton"`` (the ``torch.ops.dmuon`` op with its Triton
    kernel), ``"reference"`` (the op with its torch reference: no CUDA), ``"quack"``
    (``quack.gemm_interface.gemm_symmetric``, the ``[quack]`` extra) or ``"cublas"`` (plain
    ``mm``/``addmm``/``baddbmm``), and why."""

    kernel: str
    reason: str

    @property
    def uses_op(self) -> bool:
        """Whether the product goes through ``torch.ops.dmuon`` (Triton or its reference)."""
        return self.kernel in (TRITON, REFERENCE)


def size_gate(m: int, batch: int = 1) -> bool:
    """Whether an m×m symmetric product (a stack of ``batch``) is large enough for Triton.

    >>> size_gate(4096), size_gate(1536, batch=8), size_gate(2048), size_gate(768, batch=16)
    (True, True, False, False)
    >>> size_gate(768, batch=32)
    True
    """
    return (
        m >= TRITON_MIN_ROWS
        or (m >= TRITON_MIN_ROWS_BATCHED and batch >= TRITON_MIN_BATCH)
        or (m >= TRITON_MIN_ROWS_LARGE_STACK and batch >= TRITON_MIN_BATCH_LARGE_STACK)
    )


def choose_kernel(
    site: str,
    *,
    m: int | None = None,
    batch: int = 1,
    dtype: torch.dtype | None = None,
    device: str | None = None,
    requested: str = "auto",
    resolved: str = CUBLAS,
    cuda_machine: bool | None = None,
) -> KernelChoice:
    """Triton or cuBLAS for one symmetric product (or one compiled step), by these rules.

    Args:
        site: who asks. ``"eager"``: eager NS, per product; ``"step"``: the compiled step, once
            (does it run the NS-chain pass at all); ``"graph"``: the pass, per product of a
            compiled graph (only asked when ``"step"`` said yes); ``"op"``: inside
            ``torch.ops.dmuon`` on CUDA when autotune does not time (``DMUON_SYRK_AUTOTUNE=0``
            or a CUDA graph being captured).
        m, batch: the m×m output and the stack size of the product.
        dtype: the product's dtype (read at ``"op"`` only).
        device: the product's device type (read at ``"graph"``, and at ``"eager"`` for quack).
        requested: ``NewtonSchulz.requested_kernel``: ``"auto"``, ``"triton"``, ``"quack"`` or
            ``"cublas"`` (``deterministic=True`` is ``"cublas"``).
        resolved: ``NewtonSchulz.kernel``: what its kernel ladder resolved on this machine
            (``"triton"`` only with SM80+ CUDA and Triton, and ``DMUON_NS_KERNEL`` not
            ``cublas``).
        cuda_machine: whether this process sees a CUDA device (default: it is detected).

    Rules, first match wins:

    1. **Requested cuBLAS** (``kernel="cublas"`` or ``deterministic=True``): cuBLAS
       everywhere, the compiled step included (it then runs without the pass) — the documented
       way to isolate a suspected SYRK kernel.
    1b. **Requested quack** (``kernel="quack"``; ``NewtonSchulz`` checked that quack imports
       and a CUDA GPU is there): the compiled step runs without the NS-chain pass (the traced
       chain calls quack's ops); eager NS and the traced chain run quack's ``gemm_symmetric``
       for fp16/bf16 CUDA products with m ≥ ``QUACK_MIN_ROWS``, cuBLAS for the rest.
    2. **Inside the op, untimed**: Triton for fp16/bf16 with at least ``UNTIMED_MIN_ROWS`` rows of
       output per launch (m·√batch); fp32/fp64 and smaller launches run cuBLAS. Looser than the
       size gate because the op is also called directly; products from NS passed the gate.
    3. **Device**: eager NS uses the op only where ``resolved`` is Triton (the input's device
       is not consulted: a CPU tensor on a GPU machine follows the size gate to the op, which
       runs its reference). The compiled step runs the pass where ``resolved`` is Triton, and
       on a machine without CUDA (the ops run their torch reference: how CI tests the pass);
       a GPU machine without the kernels keeps the plain chain. In a compiled graph, a
       product not on CUDA is always rewritten (the reference).
    4. **Size gate** (eager NS and CUDA products of compiled graphs): Triton for m ≥
       ``TRITON_MIN_ROWS``, or m ≥ ``TRITON_MIN_ROWS_BATCHED`` in stacks of ≥
       ``TRITON_MIN_BATCH``, or m ≥ ``TRITON_MIN_ROWS_LARGE_STACK`` in stacks of ≥
       ``TRITON_MIN_BATCH_LARGE_STACK``; smaller products run cuBLAS (the kernels lose there,
       and the op's exact-symmetry mirror and host dispatch cost as much as the product).

    >>> choose_kernel("eager", m=4096, resolved="triton").kernel
    'triton'
    >>> choose_kernel("step", requested="cublas").kernel
    'cublas'
    >>> choose_kernel("op", m=512, batch=4, dtype=torch.bfloat16).kernel
    'triton'
    """
    if site not in SITES:
        raise ValueError(f"choose_kernel(site={site!r}): choose one of {SITES}")
    if requested == CUBLAS:
        return KernelChoice(CUBLAS, "kernel='cublas' / deterministic=True requested")
    if requested == QUACK and site in ("step", "eager"):
        return _quack_choice(site, m, dtype, device)
    if site == "op":
        if m is None:
            raise ValueError("choose_kernel('op', ...) needs m (rows of the output)")
        uses_triton, why = untimed_choice(m, batch, dtype)  # the kernel package's rule
        return KernelChoice(TRITON if uses_triton else CUBLAS, why)
    if site == "step":
        if resolved == TRITON:
            return KernelChoice(TRITON, "the Triton kernels run here")
        if cuda_machine is None:
            cuda_machine = torch.cuda.is_available()
        if not cuda_machine:
            return KernelChoice(REFERENCE, "no CUDA: the ops run their torch reference")
        return KernelChoice(CUBLAS, "no Triton kernels on this GPU: the plain chain")
    if m is None:
        raise ValueError(f"choose_kernel({site!r}, ...) needs m (rows of the output)")
    if site == "eager" and resolved != TRITON:
        return KernelChoice(CUBLAS, f"kernel resolved to {resolved}")
    if site == "graph" and device != "cuda":
        return KernelChoice(REFERENCE, f"{device} product: the op's torch reference")
    if not size_gate(m, batch):
        return KernelChoice(
            CUBLAS, f"{batch}×{m}×{m} output is below the Triton size gate: cuBLAS, as in eager NS"
        )
    return KernelChoice(TRITON, f"{batch}×{m}×{m} output passes the Triton size gate")


def _quack_choice(site: str, m: int | None, dtype, device: str | None) -> KernelChoice:
    """Rule 1b of :func:`choose_kernel` (``kernel="quack"``)."""
    if site == "step":
        return KernelChoice(QUACK, "kernel='quack': the traced chain calls quack, no NS-chain pass")
    if m is None:
        raise ValueError("choose_kernel('eager', requested='quack') needs m (rows of the output)")
    if device != "cuda" or dtype not in HALF_DTYPES:
        return KernelChoice(CUBLAS, f"kernel='quack' runs fp16/bf16 on CUDA; {dtype} on {device}")
    if m < QUACK_MIN_ROWS:
        return KernelChoice(CUBLAS, f"{m}×{m} output is below quack's tile ({QUACK_MIN_ROWS})")
    return KernelChoice(QUACK, f"{m}×{m} {dtype}: quack's gemm_symmetric")
