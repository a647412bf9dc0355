"""Newton–Schulz orthogonalisation: the eager reference every fast path is tested against.

Two algorithms (see docs/architecture.md, Newton–Schulz), both for X of shape (m, n) with
m ≤ n (tall inputs are transposed) or batched (batch, m, n):

- **direct**: per step A = X·Xᵀ, B = b·A + c·A², X ← a·X + B·X (computed as (B + a·I)·X).
- **gram**: every odd polynomial of X is Q·X with Q a polynomial of R = X·Xᵀ, so the iteration
  runs on m×m matrices and only the first X·Xᵀ and the final Q·X touch the long side:
  Z = b·R + c·R²; Q ← Q·Z + a·Q (Q = Z + a·I on a segment's first step);
  RZ = R·Z + a·R; R ← Z·RZ + a·RZ. Half precision lets tiny negative eigenvalues of R grow, so
  the iteration *restarts* (X ← Q·X, R recomputed, Q reset) at ``restart_iterations``.

The matrix products go through a primitives object: ``TorchPrimitives`` issues plain
``mm``/``addmm`` (cuBLAS on GPU) — the graph the compiler pass pattern-matches —,
``CustomOpPrimitives`` calls ``torch.ops.dmuon.*`` (Triton on CUDA) and ``QuackPrimitives``
calls Dao-AILab's quack ``gemm_symmetric`` (``kernel="quack"``, the ``[quack]`` extra).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from dmuon_compile import coefficients as coeffs
from dmuon_compile import ns_graphs
from dmuon_compile.env import ns_kernel as ns_kernel_override
from dmuon_compile.kernel_choice import (  # noqa: F401  (the size gate's constants, re-exported)
    QUACK,
    TRITON_MIN_BATCH,
    TRITON_MIN_ROWS,
    TRITON_MIN_ROWS_BATCHED,
    choose_kernel,
)
from dmuon_compile.kernels.availability import device_tag, triton_status
from dmuon_compile.kernels.consistency import agree_across_ranks

EPS = 1e-7
BACKENDS = ("gram", "direct")
KERNELS = ("auto", "triton", "quack", "cublas")
QUACK_INSTALL = 'pip install "dmuon_compile[quack]"'
# Kernel names users bring from other Muon code (CuTe/CUTLASS SYRK kernels, "syrk"), by the
# prefix, with this package's kernel that does the same: an error names it (no silent alias,
# since quack needs its extra and a GPU).
KERNEL_EQUIVALENTS = (
    ("cute", "quack"),
    ("cutlass", "quack"),
    ("syrk", "triton"),
    ("triton", "triton"),
    ("torch", "cublas"),
)
EQUIVALENT_NOTES = {
    "quack": f"Dao-AILab's CuTe DSL gemm_symmetric, CUDA SM80+: {QUACK_INSTALL}",
    "triton": "the Triton SYRK kernels, SM80+ CUDA",
    "cublas": "plain torch matmuls, every device",
}


def unknown_kernel_error(kernel) -> ValueError:
    """The error for a ``kernel=`` this package does not have: the kernels it has and, for a
    name from elsewhere, the nearest one here."""
    message = f"NewtonSchulz(kernel={kernel!r}): choose one of {KERNELS}"
    name = str(kernel).strip().lower()
    near = next((ours for prefix, ours in KERNEL_EQUIVALENTS if name.startswith(prefix)), None)
    if near is not None:
        message += (
            f". {kernel!r} is not a kernel of dmuon_compile; the nearest is kernel={near!r} "
            f"({EQUIVALENT_NOTES[near]})"
        )
    message += (
        ". kernel='auto' (the default) runs the Triton SYRK kernels where they work, else cuBLAS."
    )
    return ValueError(message)


# Below this aspect ratio n/m Gram NS saves no FLOPs over direct NS
# (docs/architecture.md, Newton–Schulz).
DEFAULT_GRAM_MIN_ASPECT = 1.5
# The most bytes one batched Newton–Schulz call stacks (its input, as given): a longer stack, or
# a shape bucket of the step past it, is cut into several calls. NS's working set is a few times
# its input (iterate, next value, one product), so this bounds the step's peak above the
# directions; 4 GiB still holds 16 fp32 matrices of 4096×16384, enough to fill a GPU.
DEFAULT_STACK_BYTES = 4 << 30


def _traced(t: Tensor) -> bool:
    """Whether ``t`` is being traced (Dynamo, or make_fx/AOT's fake or functional tensors) rather
    than computed: traced code keeps the plain expressions the compiler pass recognises."""
    return torch.compiler.is_compiling() or type(t) not in (torch.Tensor, torch.nn.Parameter)


# ----------------------------------------------------------------------------- primitives
class TorchPrimitives:
    """Matrix products as plain aten ops (cuBLAS on GPU, the CPU BLAS elsewhere)."""

    name = "cublas"

    @staticmethod
    def gram(x: Tensor) -> Tensor:
        """x·xᵀ"""
        return x @ x.mT

    @staticmethod
    def sym_addmm(
        c: Tensor, a: Tensor, b: Tensor, beta: float, alpha: float, gamma: float = 0.0
    ) -> Tensor:
        """beta·c + alpha·a·b (+ gamma·I) where the result is symmetric."""
        if a.dim() == 2:
            out = torch.addmm(c, a, b, beta=beta, alpha=alpha)
        else:
            out = torch.baddbmm(c, a, b, beta=beta, alpha=alpha)
        # Traced, the identity term is the eye expression the NS-chain pass folds into the
        # symmetric product's epilogue (``gamma``).
        return TorchPrimitives.add_identity(out, gamma) if gamma != 0.0 else out

    @staticmethod
    def add_identity(a: Tensor, gamma: float) -> Tensor:
        """a + gamma·I"""
        if not _traced(a):
            # Eager: a copy plus a strided add on the diagonal, with gamma kept in fp32 until the
            # one rounding (as Inductor's fused kernel does). The eye expression below costs a
            # fill, a multiply (gamma rounded to the work dtype) and an add that broadcasts over
            # a stack in a non-vectorised loop.
            out = a.clone(memory_format=torch.contiguous_format)
            diagonal = out.diagonal(dim1=-2, dim2=-1)
            wide = torch.promote_types(a.dtype, torch.float32)  # CPU's half add_ would round gamma
            diagonal.copy_(diagonal.to(wide) + gamma)
            return out
        # Traced: kept as an ``eye`` expression, which the symmetry pass recognises.
        eye = torch.eye(a.shape[-1], dtype=a.dtype, device=a.device)
        return a + gamma * eye

    @staticmethod
    def apply_left(c: Tensor, q: Tensor, x: Tensor, beta: float) -> Tensor:
        """beta·c + q·x (rectangular; ``beta=0`` gives q·x)."""
        if beta == 0.0:
            return q @ x
        if q.dim() == 2:
            return torch.addmm(c, q, x, beta=beta)
        return torch.baddbmm(c, q, x, beta=beta)


def _eager_cuda_kernels(t: Tensor):
    """The CUDA kernel module when ``t`` is on CUDA and nothing is tracing, else ``None``.

    Eager calls skip the op dispatcher (Python time per call, a dozen or more calls per matrix:
    ``benchmarks/host_overhead.py``); traced code (torch.compile, the compiler pass) still sees
    ``torch.ops.dmuon.*``.
    """
    if not t.is_cuda or torch.compiler.is_compiling():
        return None
    try:
        from dmuon_compile.kernels import syrk
    except ImportError:  # no triton: the registered op falls back to the reference
        return None
    return syrk


class CustomOpPrimitives(TorchPrimitives):
    """Symmetric products through ``torch.ops.dmuon`` (Triton SYRK kernels on CUDA)."""

    name = "triton"

    @staticmethod
    def gram(x: Tensor) -> Tensor:
        kernels = _eager_cuda_kernels(x)
        if kernels is not None:
            return kernels.syrk_cuda(x, None, 1.0, 0.0, 0.0)
        return torch.ops.dmuon.syrk(x, None, 1.0, 0.0, 0.0)

    @staticmethod
    def sym_addmm(
        c: Tensor, a: Tensor, b: Tensor, beta: float, alpha: float, gamma: float = 0.0
    ) -> Tensor:
        kernels = _eager_cuda_kernels(a)
        if kernels is not None:
            return kernels.sym_mm_cuda(a, b, c, alpha, beta, gamma)
        return torch.ops.dmuon.sym_mm(a, b, c, alpha, beta, gamma)


class QuackPrimitives(TorchPrimitives):
    """Symmetric products through Dao-AILab's quack ``gemm_symmetric`` (CuTe DSL kernels that
    compute one triangle and mirror it; ``kernel="quack"``). Rectangular products stay cuBLAS."""

    name = "quack"

    @staticmethod
    def gram(x: Tensor) -> Tensor:
        return quack_gemm_symmetric()(x, x.mT)

    @staticmethod
    def sym_addmm(
        c: Tensor, a: Tensor, b: Tensor, beta: float, alpha: float, gamma: float = 0.0
    ) -> Tensor:
        out = quack_gemm_symmetric()(a, b, C=c, alpha=float(alpha), beta=float(beta))
        return TorchPrimitives.add_identity(out, gamma) if gamma != 0.0 else out


def quack_gemm_symmetric():
    """``quack.gemm_interface.gemm_symmetric`` (``alpha·A·B + beta·C``, the result symmetric),
    or an ``ImportError`` naming the extra that installs it."""
    try:
        from quack.gemm_interface import gemm_symmetric
    except ImportError as exc:
        raise ImportError(
            f"NewtonSchulz(kernel='quack') needs Dao-AILab's quack kernels, which are not "
            f"importable here ({exc}). Install them with: {QUACK_INSTALL} (a CUDA GPU, SM80 or "
            "newer), or use kernel='auto' (Triton SYRK, else cuBLAS)."
        ) from exc
    return gemm_symmetric


# ----------------------------------------------------------------------------- algorithms
def _as_matrix_stack(g: Tensor) -> tuple[Tensor, bool]:
    """View ``g`` as (m, n) or (batch, m, n) with m ≤ n; return it and whether it was transposed.

    Parameters with more than 2 dims (conv kernels) are viewed as (shape[0], prod(rest)) by
    the caller (:func:`matrix_view`); here 2-D and 3-D are the only shapes.
    """
    if g.dim() not in (2, 3):
        raise ValueError(
            "Newton–Schulz needs a 2-D matrix or a 3-D stack of matrices, "
            f"got shape {tuple(g.shape)}; "
            "use dmuon_compile.matrix_view(t) for parameters with more than 2 dims"
        )
    transposed = g.shape[-2] > g.shape[-1]
    return (g.mT if transposed else g), transposed


def matrix_view(t: Tensor) -> Tensor:
    """View a parameter (or gradient) as the matrix Muon orthogonalises: (shape[0], prod(rest)).

    >>> matrix_view(torch.zeros(8, 4, 3, 3)).shape
    torch.Size([8, 36])
    """
    if t.dim() < 2:
        raise ValueError(f"Muon needs a parameter with at least 2 dims, got shape {tuple(t.shape)}")
    return t if t.dim() == 2 else t.reshape(t.shape[0], -1)


def frobenius_norm(g: Tensor, work_dtype: torch.dtype, by_rows: bool = False) -> Tensor:
    """Per-matrix Frobenius norm of ``g`` (2-D, or a 3-D stack), kept as ``(…, 1, 1)``, in fp32
    (fp64 for an fp64 work dtype): the norm :func:`normalize` divides by. The compiled step
    also takes its finite flags from it (``functional.muon_directions``) and hands the same
    tensor to :class:`NewtonSchulz`: one reduction in the graph, not two.

    ``by_rows``: as two reductions, each row's norm, then the norm of those. Traced over a large
    matrix or stack the first is an inner reduction of contiguous rows and the second a small
    one; one reduction per whole matrix has few outputs, which Inductor splits and runs below
    the memory bandwidth. Equal up to rounding; it overflows where the other does (a sum of
    squares past the fp32 range)."""
    compute = torch.float64 if work_dtype == torch.float64 else torch.float32
    if g.dtype not in (torch.float16, torch.bfloat16):
        g = g.to(compute)
    # Half inputs: the reduction upcasts in-kernel; no fp32 copy of g is written for the norm.
    if by_rows:
        rows = torch.linalg.vector_norm(g, dim=-1, keepdim=True, dtype=compute)
        return torch.linalg.vector_norm(rows, dim=-2, keepdim=True)
    return torch.linalg.vector_norm(g, dim=(-2, -1), keepdim=True, dtype=compute)


def normalize(
    g: Tensor,
    work_dtype: torch.dtype,
    eps: float = EPS,
    transpose: bool = False,
    norm: Tensor | None = None,
) -> Tensor:
    """Scale each matrix to Frobenius norm ≤ 1 (in fp32 or better), then cast to the work dtype;
    ``transpose=True`` returns the scaled ``g.mT``. ``norm``: ``frobenius_norm(g, work_dtype)``
    if the caller has it already (the compiled step's finite flags): traced, two calls of the
    norm stay two reductions (Inductor does not merge them), a full read of ``g`` each.

    The norm is taken over ``g`` in its own layout, before any transpose: in the compiled step a
    reduction over a transposed view of a tall stack reads memory with a stride, far slower
    than a contiguous read.
    A zero or tiny-norm input stays (near) zero instead of becoming NaN: the eps is added to
    the norm, never divided by alone.
    """
    compute = torch.float64 if work_dtype == torch.float64 else torch.float32
    if g.dtype not in (torch.float16, torch.bfloat16):
        g = g.to(compute)  # fp32/fp64 inputs: at most a cast of a full-precision tensor
    denom = (frobenius_norm(g, work_dtype) if norm is None else norm) + eps
    if work_dtype != compute and not _traced(g):
        # Eager: divide in fp32 and round once, on store, to the work dtype, in one pass over g
        # (the expression below would write a full-size fp32 temporary first).
        x = _eager_scale_cast(g, denom, work_dtype)
    else:  # traced: Inductor fuses this into one pass
        x = (g.to(compute) / denom).to(work_dtype)
    return x.mT if transpose else x


def _eager_scale_cast(g: Tensor, denom: Tensor, dtype: torch.dtype) -> Tensor:
    """``g / denom`` rounded once to ``dtype``: one Triton pass on CUDA (kernels/scale_cast.py;
    PyTorch's casting loop for this is not vectorised), ``torch.div(out=)`` elsewhere. Same bits."""
    if g.is_cuda and g.is_contiguous() and triton_status(g.device.index)[0]:
        try:
            from dmuon_compile.kernels.scale_cast import scale_cast
        except ImportError:  # no triton: the torch path below
            pass
        else:
            return scale_cast(g, denom, dtype)
    return torch.div(g, denom, out=torch.empty_like(g, dtype=dtype))


def direct_ns(x: Tensor, table: coeffs.Coefficients, ops=TorchPrimitives) -> Tensor:
    """Direct NS on a normalised (m, n)/(batch, m, n) input with m ≤ n; returns the same shape."""
    for a, b, c in table:
        gram = ops.gram(x)  # A = X·Xᵀ
        # B + a·I = c·A² + b·A + a·I, the identity term in the symmetric product's epilogue
        # (fp32, one rounding), so that X ← a·X + B·X is the product (B + a·I)·X with no C
        # term: a C term would make cuBLAS copy X into the output before every product
        # (out ≠ C), a full read and write of X per step.
        poly = ops.sym_addmm(gram, gram, gram, beta=b, alpha=c, gamma=a)
        del gram  # eager: A is X-sized for a square X; free it before X's next value
        x = ops.apply_left(x, poly, x, beta=0.0)  # X ← (B + a·I)·X
    return x


def gram_ns(
    x: Tensor, table: coeffs.Coefficients, restart_iterations: Sequence[int], ops=TorchPrimitives
) -> Tensor:
    """Gram NS with restarts on a normalised (m, n)/(batch, m, n) input with m ≤ n."""
    restarts = set(restart_iterations)
    steps = len(table)
    r = ops.gram(x)
    q: Tensor | None = None
    for i, (a, b, c) in enumerate(table):
        if i in restarts and q is not None:
            x = ops.apply_left(x, q, x, beta=0.0)  # X ← Q·X
            r = ops.gram(x)
            q = None
        z = ops.sym_addmm(r, r, r, beta=b, alpha=c)  # Z = b·R + c·R²
        # Q·(Z + aI) as Q·Z + a·Q keeps the a·I term out of the half-precision products: the
        # faster form W = Z + aI (no C terms) loses accuracy on the top singular directions of
        # a decaying spectrum.
        q = ops.add_identity(z, a) if q is None else ops.sym_addmm(q, q, z, beta=a, alpha=1.0)
        last_of_segment = i + 1 == steps or (i + 1) in restarts
        if not last_of_segment:
            rz = ops.sym_addmm(r, r, z, beta=a, alpha=1.0)  # RZ = R·Z + a·R
            r = ops.sym_addmm(rz, z, rz, beta=a, alpha=1.0)  # R ← Z·RZ + a·RZ
    return ops.apply_left(x, q, x, beta=0.0)  # X ← Q·X


class NSProduct(NamedTuple):
    """One kind of matrix product (or pass) of Newton–Schulz on one matrix: how many times it runs,
    its FLOPs and the fewest bytes it moves each time (operands read once, its output written
    once, in the work dtype: a symmetric output written whole, a ``beta·C`` term read as its
    lower triangle). FLOPs against bytes say whether a product can reach the GPU's FLOP rate:
    Gram-space products of a few hundred rows cannot (``m / 7`` FLOPs per byte in 16 bits: 110
    at m = 768, against an H100's ~225 FLOPs per byte of HBM)."""

    kind: str
    count: int
    flops: float
    bytes: float


def gram_ns_products(
    m: int, n: int, steps: int, restarts: int, symmetric: bool = True, itemsize: int = 2
) -> list[NSProduct]:
    """:func:`gram_ns`' products on one (m, n) matrix, m ≤ n (symmetric ones at half cost)."""
    half = 0.5 if symmetric else 1.0
    segments = restarts + 1
    # Per step: Z (1 product) and Q (1, none on a segment's first step) and R (2, none on a
    # segment's last step); a segment's first Q is Z + a·I (a pass, no product).
    small = steps + 3 * (steps - segments)
    square, wide = m * m, m * n
    return [
        NSProduct("X·Xᵀ", segments, half * 2 * square * n, itemsize * (wide + square)),
        NSProduct("Q·X", segments, 2 * square * n, itemsize * (square + 2 * wide)),
        NSProduct("m×m with C", small, half * 2 * m**3, itemsize * 3.5 * square),
        NSProduct("Z + a·I", segments, 0.0, itemsize * 2 * square),
    ]


def direct_ns_products(
    m: int, n: int, steps: int, symmetric: bool = True, itemsize: int = 2
) -> list[NSProduct]:
    """:func:`direct_ns`' products on one (m, n) matrix, m ≤ n."""
    half = 0.5 if symmetric else 1.0
    square, wide = m * m, m * n
    return [
        NSProduct("X·Xᵀ", steps, half * 2 * square * n, itemsize * (wide + square)),
        NSProduct("m×m with C", steps, half * 2 * m**3, itemsize * 3.5 * square),
        NSProduct("(B + a·I)·X", steps, 2 * square * n, itemsize * (square + 2 * wide)),
    ]


def gram_ns_flops(m: int, n: int, steps: int, restarts: int, symmetric: bool = True) -> float:
    """FLOPs of Gram NS on one (m, n) matrix, m ≤ n (symmetric products counted at half cost)."""
    return sum(p.count * p.flops for p in gram_ns_products(m, n, steps, restarts, symmetric))


def direct_ns_flops(m: int, n: int, steps: int, symmetric: bool = True) -> float:
    """FLOPs of direct NS on one (m, n) matrix, m ≤ n."""
    return sum(p.count * p.flops for p in direct_ns_products(m, n, steps, symmetric))


# ----------------------------------------------------------------------------- public class
_ACTIVE: NewtonSchulz | None = None


class NewtonSchulz:
    """A configured Newton–Schulz orthogonaliser.

    Args:
        backend: ``"gram"`` (default; Gram-space iteration with restarts, direct NS for
            near-square matrices where Gram saves nothing) or ``"direct"``.
        kernel: ``"auto"`` (Triton SYRK kernels on SM80+ CUDA where available, else cuBLAS;
            ``DMUON_NS_KERNEL`` overrides it), ``"triton"``, ``"quack"`` (Dao-AILab's quack
            ``gemm_symmetric``: ``pip install "dmuon_compile[quack]"``, SM80+; raises
            ``ImportError`` naming that command when quack is not installed) or ``"cublas"``.
        coefficients: a table name (``"keller_jordan"``, ``"you"``, ``"polar_express"``), one
            ``(a, b, c)`` triple or a per-step sequence. Default: Polar Express (safety 1.05)
            for gram, Keller Jordan for direct (torch.optim.Muon's).
        restart_iterations: Gram NS restart positions (default ``(2,)``).
        deterministic: ``True`` is the same as ``kernel="cublas"``.
        steps: number of NS steps for named tables / single triples (default 5).
        work_dtype: dtype of the iteration (default: fp16 for gram, bf16 for direct on GPUs;
            fp32 for CPU inputs).
        gram_min_aspect: matrices with n/m below this run direct NS (default 1.5).
        eps: added to the Frobenius norm before dividing.
        stack_bytes: the most bytes of input one batched call stacks (default 4 GiB,
            ``DEFAULT_STACK_BYTES``): a longer stack runs as several calls, and the optimizer
            step cuts its shape buckets to it. Bounds the step's working memory (a few times
            this) above the directions it keeps.

    Example::

        ns = dmuon.NewtonSchulz(kernel="cublas")   # same as deterministic=True
        update = ns(torch.randn(256, 1024))
    """

    def __init__(
        self,
        backend: str = "gram",
        kernel: str = "auto",
        coefficients=None,
        restart_iterations: Sequence[int] | None = None,
        deterministic: bool = False,
        *,
        steps: int | None = None,
        work_dtype: torch.dtype | None = None,
        gram_min_aspect: float = DEFAULT_GRAM_MIN_ASPECT,
        eps: float = EPS,
        stack_bytes: int = DEFAULT_STACK_BYTES,
    ) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"NewtonSchulz(backend={backend!r}): choose one of {BACKENDS}")
        if kernel not in KERNELS:
            raise unknown_kernel_error(kernel)
        if deterministic and kernel in ("triton", QUACK):
            raise ValueError(
                f"NewtonSchulz(kernel={kernel!r}, deterministic=True) conflict: deterministic=True "
                "means kernel='cublas'. Drop one of the two."
            )
        self.backend = backend
        self.requested_kernel = "cublas" if deterministic else kernel
        self.deterministic = deterministic or kernel == "cublas"
        default_table = "polar_express" if backend == "gram" else "keller_jordan"
        self.coefficients = coeffs.resolve(coefficients, default_table, steps)
        n_steps = len(self.coefficients)
        if restart_iterations is None:
            restart_iterations = (2,) if backend == "gram" and n_steps > 2 else ()
        restart_iterations = tuple(sorted(set(int(i) for i in restart_iterations)))
        for i in restart_iterations:
            if not 0 < i < n_steps:
                raise ValueError(
                    f"restart_iterations={restart_iterations}: each restart must be a step index "
                    f"in 1..{n_steps - 1} (there are {n_steps} steps)"
                )
        if restart_iterations and backend != "gram":
            raise ValueError("restart_iterations only applies to backend='gram'")
        self.restart_iterations = restart_iterations
        if work_dtype is not None and work_dtype not in (
            torch.float16,
            torch.bfloat16,
            torch.float32,
            torch.float64,
        ):
            raise ValueError(f"work_dtype={work_dtype} is not a floating dtype NS can run in")
        self.requested_work_dtype = work_dtype
        # The accelerator default; CPU inputs run in fp32 unless work_dtype is given (CPUs have
        # no fast half-precision matmul).
        self.work_dtype = work_dtype or (torch.float16 if backend == "gram" else torch.bfloat16)
        if gram_min_aspect < 1.0:
            raise ValueError(f"gram_min_aspect must be >= 1 (got {gram_min_aspect})")
        self.gram_min_aspect = gram_min_aspect
        self.eps = eps
        if isinstance(stack_bytes, bool) or not isinstance(stack_bytes, int) or stack_bytes < 1:
            raise ValueError(
                f"NewtonSchulz(stack_bytes={stack_bytes!r}): give a positive number of bytes, "
                f"e.g. {DEFAULT_STACK_BYTES} (4 GiB, the default)"
            )
        self.stack_bytes = stack_bytes
        self.kernel, self.kernel_reason = self._resolve_kernel(self.requested_kernel)
        self._graphed = ns_graphs.GraphedCalls()  # per-shape CUDA graphs of small eager calls

    # -- kernel ladder
    @staticmethod
    def _resolve_kernel(requested: str) -> tuple[str, str]:
        env = ns_kernel_override()
        if requested == "auto" and env:
            requested = env
        if requested == QUACK:
            quack_gemm_symmetric()  # ImportError naming the extra
            if not torch.cuda.is_available():
                raise RuntimeError(
                    "NewtonSchulz(kernel='quack') needs a CUDA GPU (SM80 or newer): quack's "
                    "kernels are CUDA only. Use kernel='auto' or kernel='cublas' here."
                )
            return QUACK, f"{device_tag()}, quack gemm_symmetric, cuBLAS below its tile"
        ok, why = triton_status()
        tag = device_tag()
        if requested == "triton":
            if not ok:
                raise RuntimeError(
                    f"NewtonSchulz(kernel='triton') is not available here: {why}. "
                    "Use kernel='auto' (falls back to cuBLAS) or kernel='cublas'."
                )
            return "triton", f"{tag}, Triton SYRK templates"
        if requested == "auto" and ok:
            return "triton", f"{tag}, Triton SYRK templates, cuBLAS where autotune prefers it"
        return "cublas", f"{tag}, universal fallback"

    def work_dtype_for(self, device: torch.device) -> torch.dtype:
        """The iteration dtype for inputs on ``device`` (the given ``work_dtype``, else fp16 for
        gram / bf16 for direct on accelerators and fp32 on the CPU)."""
        if self.requested_work_dtype is not None:
            return self.requested_work_dtype
        return torch.float32 if device.type == "cpu" else self.work_dtype

    def primitives_for(
        self,
        m: int,
        batch: int = 1,
        device: str | None = None,
        dtype: torch.dtype | None = None,
    ):
        """The product implementation for an (m, ·) matrix (stack of ``batch``, iterated in
        ``dtype`` on ``device``): the project ops where
        :func:`~dmuon_compile.kernel_choice.choose_kernel` picks them for eager NS (resolved
        kernel Triton and the size gate passed), quack's where it picks quack, the plain
        cuBLAS chain otherwise."""
        choice = choose_kernel(
            "eager",
            m=m,
            batch=batch,
            dtype=dtype,
            device=device,
            requested=self.requested_kernel,
            resolved=self.kernel,
        )
        if choice.kernel == QUACK:
            return QuackPrimitives
        return CustomOpPrimitives if choice.uses_op else TorchPrimitives

    def describe(self) -> str:
        """One honest line naming the algorithm and the active kernel."""
        algo = "Gram NS" if self.backend == "gram" else "Direct NS"
        return f"{algo} · kernel={self.kernel} ({self.kernel_reason})"

    def uses_gram(self, m: int, n: int) -> bool:
        """Whether an (m, n) matrix runs Gram NS (else direct NS)."""
        small, large = min(m, n), max(m, n)
        return self.backend == "gram" and large >= self.gram_min_aspect * small

    def flops(self, m: int, n: int) -> float:
        """FLOPs of one orthogonalisation of an (m, n) matrix with this configuration."""
        small, large = min(m, n), max(m, n)
        sym = self.kernel in ("triton", QUACK)  # symmetric products: one triangle
        if self.uses_gram(small, large):
            return gram_ns_flops(
                small, large, len(self.coefficients), len(self.restart_iterations), sym
            )
        return direct_ns_flops(small, large, len(self.coefficients), sym)

    def __call__(self, g: Tensor, norm: Tensor | None = None) -> Tensor:
        """Orthogonalise ``g`` (2-D, or a 3-D same-shape stack); returns the work dtype.

        ``norm``: ``frobenius_norm(g, self.work_dtype_for(g.device))``, if the caller took it
        already (it is then not taken again). Small CUDA inputs replay a per-shape CUDA graph of
        this same call after the first one (:mod:`dmuon_compile.ns_graphs`: bitwise the eager
        result, no launch overhead); with a ``norm`` they run directly.
        """
        if norm is not None and tuple(norm.shape) != tuple(g.shape[:-2]) + (1, 1):
            raise ValueError(
                f"NewtonSchulz: norm has shape {tuple(norm.shape)}, expected "
                f"{tuple(g.shape[:-2]) + (1, 1)} (one per matrix, keepdim): pass "
                "frobenius_norm(g, ns.work_dtype_for(g.device)), or leave it out"
            )
        per_call = self.matrices_per_call(g.shape[-2:], g.element_size())
        if g.dim() == 3 and g.shape[0] > per_call:
            return self._in_pieces(g, norm, per_call)
        if norm is None and ns_graphs.wanted(g):
            return self._graphed(self._config_key(g.device), self._orthogonalize, g)
        return self._orthogonalize(g, norm)

    def matrices_per_call(self, shape: Sequence[int], element_size: int = 4) -> int:
        """How many (m, n) matrices of ``element_size`` bytes one call stacks (at least one).

        A zero-size matrix (``m`` or ``n`` is 0) takes no memory: one call takes any number of
        them (NS of an empty matrix is the empty matrix, as ``torch.optim.Muon`` leaves it).

        >>> NewtonSchulz().matrices_per_call((0, 32)) == sys.maxsize
        True
        """
        size = int(shape[0]) * int(shape[1]) * int(element_size)
        if size <= 0:
            return sys.maxsize
        return max(1, self.stack_bytes // size)

    def _in_pieces(self, g: Tensor, norm: Tensor | None, per_call: int) -> Tensor:
        """A stack past ``stack_bytes`` as several calls, each result copied into one output
        (each piece's working set is freed before the next piece's is made)."""
        out = None
        for start in range(0, g.shape[0], per_call):
            piece = slice(start, start + per_call)
            r = self(g[piece], None if norm is None else norm[piece])
            if out is None:
                out = r.new_empty((g.shape[0], *r.shape[1:]))
            out[piece].copy_(r)
            del r
        return out

    def _config_key(self, device: torch.device) -> tuple:
        """Everything that selects the kernels of a call besides the input (graph cache key;
        a ``copy.copy`` of this object with another ``kernel`` must not share graphs)."""
        return (
            self.backend,
            self.kernel,
            self.coefficients,
            self.restart_iterations,
            self.work_dtype_for(device),
            self.gram_min_aspect,
            self.eps,
        )

    def _orthogonalize(self, g: Tensor, norm: Tensor | None = None) -> Tensor:
        _, transposed = _as_matrix_stack(g)  # validates the shape
        work_dtype = self.work_dtype_for(g.device)
        # The normalised input goes straight in (no local name here): NS frees it after its
        # first step instead of keeping a matrix-sized copy alive to the end.
        return self.orthogonalize_normalized(
            normalize(g, work_dtype, self.eps, transpose=transposed, norm=norm), transposed
        )

    def normalize_each(self, mats: Sequence[Tensor]) -> tuple[Tensor, Tensor, bool]:
        """Same-shape matrices (2-D, or 3-D stacks) normalised one by one and stacked in the work
        dtype, wide (m ≤ n; ``transposed``: each was tall): ``(x, norms, transposed)``, ``norms``
        fp32 ``(count, 1, 1)``, what :meth:`orthogonalize_normalized` takes.

        The stack of their normalised inputs, not of the inputs: traced, each input is then
        computed where it is read (the compiled step's Nesterov input, never written) and the
        only full-size write is the work-dtype stack; a stack of fp32 inputs would be written
        whole first and read twice (its norm, its scaled cast)."""
        first = mats[0]
        _, transposed = _as_matrix_stack(first)
        work_dtype = self.work_dtype_for(first.device)
        xs, norms = [], []
        for m in mats:
            norm = frobenius_norm(m, work_dtype, by_rows=True)
            x = normalize(m, work_dtype, self.eps, transpose=transposed, norm=norm)
            xs.append(x if x.dim() == 3 else x.unsqueeze(0))
            norms.append(norm.reshape(-1, 1, 1))
        return torch.cat(xs), torch.cat(norms), transposed

    def orthogonalize_normalized(self, x: Tensor, transposed: bool = False) -> Tensor:
        """Newton–Schulz of ``x``, already normalised, in the work dtype and wide (m ≤ n);
        the result transposed back where ``transposed``."""
        m, n = x.shape[-2], x.shape[-1]
        ops = self.primitives_for(m, x.shape[0] if x.dim() == 3 else 1, x.device.type, x.dtype)
        if self.uses_gram(m, n):
            x = gram_ns(x, self.coefficients, self.restart_iterations, ops)
        else:
            x = direct_ns(x, self.coefficients, ops)
        return x.mT if transposed else x

    def __repr__(self) -> str:
        return (
            f"NewtonSchulz(backend={self.backend!r}, kernel={self.kernel!r}, "
            f"steps={len(self.coefficients)}, restart_iterations={self.restart_iterations}, "
            f"work_dtype={self.work_dtype})"
        )


def set_active_ns(ns: NewtonSchulz) -> None:
    """Record the orthogonaliser that :func:`get_ns_backend` reports (``Muon`` calls this)."""
    global _ACTIVE
    _ACTIVE = ns


def get_ns_backend(ns: NewtonSchulz | None = None) -> str:
    """Describe the active Newton–Schulz backend and kernel on this rank.

    With no argument, reports the orthogonaliser of the most recently built ``Muon`` (or the
    default ``NewtonSchulz()`` if none was built). Run it on every rank and cross-check (or
    use :func:`dmuon_compile.check_ns_backend_consistent`): mixing kernels across ranks drifts.

    >>> get_ns_backend()  # doctest: +SKIP
    'Gram NS · kernel=cublas (CPU, universal fallback)'
    """
    if ns is None:
        ns = _ACTIVE if _ACTIVE is not None else NewtonSchulz()
    elif not isinstance(ns, NewtonSchulz):
        inner = getattr(ns, "ns", None)
        if not isinstance(inner, NewtonSchulz):
            raise TypeError(
                f"get_ns_backend() takes a NewtonSchulz or a Muon, got {type(ns).__name__}"
            )
        ns = inner
    return ns.describe()


def check_ns_backend_consistent(ns=None, group=None) -> str:
    """All-gather ``get_ns_backend(ns)`` over ``group`` and raise if the ranks disagree.

    Returns this rank's backend string. Without an initialised process group it only returns
    the local string. Collective: every rank of ``group`` must call it (the gather and the
    comparison are ``kernels.consistency.agree_across_ranks``).

    Example::

        opt = dmuon.Muon(model, lr=0.02)
        dmuon.check_ns_backend_consistent(opt)   # raises RuntimeError listing odd ranks
    """
    return agree_across_ranks(get_ns_backend(ns), group)


def resolve_ns_backend(ns_backend) -> NewtonSchulz:
    """``"gram"``/``"direct"``/``NewtonSchulz`` → ``NewtonSchulz``."""
    if isinstance(ns_backend, NewtonSchulz):
        return ns_backend
    if isinstance(ns_backend, str):
        if ns_backend not in BACKENDS:
            raise ValueError(
                f"ns_backend={ns_backend!r}: choose 'gram', 'direct' "
                "or pass a dmuon.NewtonSchulz(...)"
            )
        return NewtonSchulz(backend=ns_backend)
    raise TypeError(
        f"ns_backend must be 'gram', 'direct' or a NewtonSchulz, got {type(ns_backend).__name__}"
    )


def singular_value_band(table: coeffs.Coefficients, lo: float = 0.01) -> tuple[float, float]:
    """Where the composed polynomial maps input singular values in [lo, 1] (float64 scan)."""
    s = torch.linspace(lo, 1.0, 20001, dtype=torch.float64)
    for a, b, c in table:
        s = a * s + b * s**3 + c * s**5
    return float(s.min()), float(s.max())
