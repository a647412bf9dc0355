"""The agreement between the two halves of a Muon step: every rank commits, skips or raises
together.

``Muon.step`` computes every matrix's update first (writing nothing), then calls
:meth:`StepAgreement.agree` (``opt._agreement``, the agreement it holds): each rank's finite
flags of its gradients (and Muon momentum buffers) and the phase in which its local work
failed, if it did, go into one all-reduce (no collective at all where every rank sees the same
gradients), and only then is anything written. A step that fails on one rank therefore raises
:class:`MuonStepError` on every rank and changes nothing anywhere; a non-finite gradient or
momentum buffer raises ``FloatingPointError`` or skips the step (``nonfinite_grads``).

The eager step reads the verdict in the step. The compiled step leaves it on the device (a
:class:`PendingVerdict`: the commit and AdamW select on it), :meth:`StepAgreement.hold` keeps
it and :meth:`StepAgreement.settle` reads it one call later (the next ``step()``,
``state_dict()``, ``last_step_committed()``), so the host never waits for the step's kernels.

The agreement reads its optimizer's ``param_groups``, ``state``, ``model``, ``nonfinite_grads``
and ``param_name`` (:class:`AgreeingOptimizer`), and writes nothing of it but for dropping the
state a step that does not commit created.
"""

from __future__ import annotations

import inspect
import os
import warnings
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple, Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from dmuon_compile.distributed._comm import collectives as C
from dmuon_compile.distributed._comm.collectives import scalar_device
from dmuon_compile.distributed._compat.c10d import default_group
from dmuon_compile.distributed._owner.tensor import local_of

# Where a parameter's finite flag came from (a half's ``path``: ``distributed/stages.py``).
from dmuon_compile.distributed.stages import COMPILED, EAGER, READ, SPLIT
from dmuon_compile.step_phases import PHASE_CHECK, STEP_PHASES, guarded

NONFINITE_MODES = ("raise", "skip")
MOMENTUM = "momentum_buffer"  # a Muon matrix's state key
GRADIENT, MOMENTUM_BUFFER = "gradient", "momentum buffer"  # what a non-finite error names
# The path that found a non-finite value, as the error names it.
FOUND_BY = {
    COMPILED: "the compiled Muon step",
    EAGER: "the eager Muon step",
    SPLIT: "the split Newton–Schulz",
    READ: "a direct read of the values",
}
# Frames the skip warning looks past to name the user's line: this package's and torch's
# (``torch.no_grad``, torch.optim's step hooks, ``torch.compiler.disable``'s wrapper).
_INTERNAL_DIRS = tuple(
    os.path.dirname(os.path.abspath(f)) + os.sep for f in (__file__, torch.__file__)
)


def _user_stacklevel() -> int:
    """``warnings.warn``'s ``stacklevel`` (counted from this function's caller) of the first
    frame outside this package and torch: the user's ``opt.step()`` (or whichever call read
    the verdict), however deep the package's own call path is."""
    level, frame = 1, inspect.currentframe().f_back
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_INTERNAL_DIRS):
        frame, level = frame.f_back, level + 1
    return level


class MuonStepError(RuntimeError):
    """Raised by ``Muon.step`` on every rank when the step failed on some rank (an exception
    in its local work: OOM, a compile or autotune error, ...). ``failed`` maps each failing rank
    to its phase; on a failing rank the original exception is the ``__cause__``. No weight and
    no optimizer state changed on any rank, and every rank left the same collectives behind:
    ``opt.zero_grad()`` on every rank and training goes on (the batch is skipped)."""

    def __init__(self, message: str, failed: dict[int, str]) -> None:
        super().__init__(message)
        self.failed = failed


if TYPE_CHECKING:
    from torch import nn

    from dmuon_compile.distributed.stages import StepStage


class AgreeingOptimizer(Protocol):
    """What :class:`StepAgreement` reads of the optimizer that holds it (``Muon``)."""

    param_groups: list[dict]
    state: dict
    model: nn.Module | None
    nonfinite_grads: str

    def param_name(self, p: Tensor) -> str: ...


class FiniteFlags(NamedTuple):
    """A Muon half's finite flags, brought to :meth:`StepAgreement.check_finite`."""

    grads: list  # the half's local gradients (they name its parameters)
    finite: Tensor  # per gradient: finite? (gradient and momentum)
    path: str  # COMPILED, EAGER or SPLIT: which step took them


@dataclass
class _StepCheck:
    """What ``Muon._prepare`` leaves for the agreement (:meth:`StepAgreement.begin`), kept on
    the agreement: never passed through a user-compiled step (the parameters are DTensors, the
    list lengths change after the first step: Dynamo would have to rebuild or guard them)."""

    params: list  # the parameters with gradients
    finite: Tensor | None  # their finite flags, on the device
    fresh: list  # those whose state this step created: dropped if the step does not commit
    # Per parameter, which check set its flag (COMPILED, EAGER or READ): only read to word the
    # error (a NaN with finite gradient and momentum means different things on each path).
    paths: list | None = None


@dataclass
class PendingVerdict:
    """A verdict left on the device by ``StepAgreement.agree(defer=True)``: ``ok`` (0-d bool)
    is what the commit and AdamW select on; :meth:`StepAgreement.hold` starts its copy to the
    host and :meth:`StepAgreement.settle` reads it, one call later."""

    check: _StepCheck
    ok: Tensor  # commit or keep every old value
    votes: Tensor | None  # the all-reduced votes where ranks' gradients differ, else None
    failure: list = field(default_factory=list)  # this rank's [(phase, exception)]
    host: _OnHost | None = None  # the votes and flags on their way to the host


class _OnHost:
    """Tensors copied to the host without making the host wait: on CUDA into pinned memory
    behind an event, which :meth:`wait` waits for (by then the GPU is usually past it)."""

    def __init__(self, tensors: list[Tensor | None]) -> None:
        self.event = None
        self.copies: list[Tensor | None] = []
        for t in tensors:
            if t is not None and t.device.type == "cuda":
                host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                host.copy_(t, non_blocking=True)
                t = host
                if self.event is None:
                    self.event = torch.cuda.Event()
            self.copies.append(t)
        if self.event is not None:
            self.event.record()

    def wait(self) -> list[Tensor | None]:
        if self.event is not None:
            self.event.synchronize()
        return self.copies


def directions_finite(ortho: list[Tensor]) -> Tensor | None:
    """Per direction NS(u) of the eager step: finite or not (a 1-D bool tensor on the device).

    Newton–Schulz normalises ``u = g + μ·buf`` by its norm and multiplies matrices: a NaN or
    Inf anywhere in the gradient or the momentum makes the norm NaN/Inf and the whole output
    NaN. So one ``foreach`` norm of the directions (NS's work dtype: at most the bytes of the
    gradients it replaces) checks both, where the compiled step reads its flags from the norms
    NS takes; the eager step keeps NS's input-only signature (its CUDA-graph replay)."""
    if not ortho:
        return None
    norms = torch._foreach_norm(ortho)
    return torch.isfinite(torch.stack([n.to(norms[0].device) for n in norms]))


def _all_finite(t: Tensor) -> bool:
    return bool(torch.isfinite(local_of(t)).all())


def _step_error(failed: dict[int, str], failure: list, deferred: bool = False) -> MuonStepError:
    where = "; ".join(f"rank {r} in {phase}" for r, phase in sorted(failed.items()))
    own = failure[0][1] if failure else None
    cause = f": {type(own).__name__}: {own}" if own is not None else " (see that rank's error)"
    err = MuonStepError(
        f"{_which_step(deferred)} failed on {where}{cause}. Every rank raises this error at "
        "the same point; "
        "the step changed no weight and no optimizer state on any rank, and every rank issued "
        "the same collectives: call opt.zero_grad() on every rank and go on (the batch is "
        "skipped), or fix the cause on the failing rank.",
        dict(failed),
    )
    err.__cause__ = own
    return err


def _elsewhere(split: bool) -> tuple:
    """What a rank without a non-finite value of its own names (``_nonfinite_names``' form):
    a split NS result (its owner's error says which) or, else, another rank's gradient."""
    if split:
        what = "the split Newton–Schulz result of a matrix its group shares: see the owner's error"
        return ("a matrix held by another rank", what, (), SPLIT)
    return ("a matrix held by another rank", "see that rank's error", (GRADIENT,), None)


def _which_step(deferred: bool) -> str:
    """How an error names its step: a deferred verdict is read by the call after the step."""
    if deferred:
        return (
            "Muon.step (the previous step, whose verdict this call read: the compiled step "
            "leaves it on the device)"
        )
    return "Muon.step"


def _nonfinite_message(bad: list[tuple], skipping: bool = False) -> str:
    """The non-finite step's message: each parameter with what is not finite in it and the
    path that found it, then the advice for those kinds of value. ``bad``: ``(name, what,
    kinds found, path or None)``."""
    shown = ", ".join(f"{name} ({what})" for name, what, *_ in bad[:8])
    if len(bad) > 8:
        shown += f" and {len(bad) - 8} more"
    kinds = {kind for _, _, found, _ in bad for kind in found}
    paths = [FOUND_BY[p] for p in FOUND_BY if any(path == p for *_, path in bad)]
    found_by = f", found by {' and '.join(paths)}" if paths else ""
    parts = [f"non-finite (NaN/Inf) values in {shown}{found_by}."]
    if GRADIENT in kinds:
        parts.append(
            "A non-finite gradient: check whether AdamW alone shows the same NaN (then the "
            "cause is upstream: data, model, dtype)."
        )
    if MOMENTUM_BUFFER in kinds:
        parts.append(
            "A non-finite momentum buffer comes from the optimizer state (a loaded checkpoint, "
            "a write to opt.state): load a good state or zero that buffer (skipping steps does "
            "not clear it)."
        )
    if not skipping:  # the skip warning: it is skipping already
        parts.append("Pass nonfinite_grads='skip' to skip such steps instead.")
    return " ".join(parts)


class StepAgreement:
    """The agreement of one optimizer's steps (see the module docstring): ``Muon`` holds one
    and calls :meth:`begin` (from ``_prepare``), :meth:`check_finite`, :meth:`agree` and, for a
    deferred verdict, :meth:`settle`; in that order, once per step.

    Args:
        opt: the optimizer (what it reads: :class:`AgreeingOptimizer`), held by a weak proxy:
            no reference cycle keeps a dropped optimizer's state alive until a GC pass.
    """

    def __init__(self, opt: AgreeingOptimizer) -> None:
        self.opt = weakref.proxy(opt)
        self.check: _StepCheck | None = None  # from begin to agree, within a step
        self.pending: PendingVerdict | None = None  # a held verdict, until settle reads it

    def begin(self, check: _StepCheck) -> None:
        """The step's parameters with gradients (and those whose state it created), before
        the directions; their flags are added by :meth:`check_finite`."""
        self.check = check

    @torch.compiler.disable  # host bookkeeping and a foreach norm: eager
    def check_finite(self, checked: list[FiniteFlags], failure: list) -> None:
        """The step's finite flags, one per parameter with a gradient, kept in
        ``self.check`` in the order the verdict names them.

        ``checked``: the :class:`FiniteFlags` of the Muon halves that brought flags
        covering both the gradient and the momentum buffer with no extra read: compiled halves
        from the norms Newton–Schulz takes of their Nesterov inputs, eager ones from a norm of
        the directions (:func:`directions_finite`). Every other gradient (AdamW, TP, expert
        shards, a failed half) is read here by one ``foreach`` norm, with the momentum buffer
        of a Muon matrix that had one before this step (a NaN there, e.g. from a loaded state,
        would otherwise be written into the weights). A failure of that read is this rank's
        failure in ``PHASE_CHECK``.
        """
        check = self.check
        by_grad = {id(local_of(p.grad)): p for p in check.params}
        covered: list = []
        paths: list[str] = []
        flags: list[Tensor] = []
        for grads, finite, path in checked:
            params = [by_grad.get(id(g)) for g in grads]
            # ``is``, not ``in``: ``None in params`` would call each tensor's ``__eq__`` (a
            # torch function per matrix on the step's host path).
            if all(p is not None for p in params):  # else read below with the rest
                covered += params
                paths += [path] * len(params)
                flags.append(finite)
        taken = {id(p) for p in covered}
        rest = [p for p in check.params if id(p) not in taken]
        if rest:
            before = len(failure)
            read = guarded(failure, PHASE_CHECK, lambda: self._read_flags(rest, check), None)
            if len(failure) > before:  # this rank's failure: the agreement raises it everywhere
                check.finite = None
                return
            flags.append(read)
        check.params = covered + rest
        check.paths = paths + [READ] * len(rest)
        if flags:
            device = flags[0].device
            check.finite = torch.cat([f.to(device).reshape(-1) for f in flags])

    def _read_flags(self, params: list, check: _StepCheck) -> Tensor | None:
        """The flags of ``params`` read directly: the gradient, and the momentum buffer of a
        Muon matrix whose state existed before this step (a new one is zeros)."""
        fresh = {id(p) for p in check.fresh}
        state = self.opt.state
        bufs = [None if id(p) in fresh else state.get(p, {}).get(MOMENTUM) for p in params]
        grads = [p.grad for p in params]
        if all(b is None for b in bufs):
            return self._finite_flags(grads)
        return self._finite_flags(grads, bufs)

    def _finite_flags(self, grads: list[Tensor], bufs: list | None = None) -> Tensor | None:
        """Per gradient: finite or not, on the device (read on the host by the agreement).
        ``bufs``: a momentum buffer (or ``None``) per gradient, checked with it."""
        if not grads:
            return None
        extra = [(i, b) for i, b in enumerate(bufs or ()) if b is not None]
        norms = list(
            torch._foreach_norm([local_of(t).float() for t in grads + [b for _, b in extra]])
        )
        if extra:
            # Norms are >= 0 or NaN/Inf: g's plus buf's is finite iff both are. One foreach add,
            # no per-matrix op on the host path.
            torch._foreach_add_([norms[i] for i, _ in extra], norms[len(grads) :])
            norms = norms[: len(grads)]
        return torch.isfinite(torch.stack([n.to(norms[0].device) for n in norms]))

    @torch.compiler.disable  # a collective, the step's one host read, Python exceptions: eager
    def agree(
        self, failure: list, unsent: list[tuple[StepStage, object]], defer: bool = False
    ) -> bool | PendingVerdict:
        """Between the two halves of the step: whether to commit (``False``: skip), or raise.

        Every rank's verdict on its gradients (finite?) and on its local work (did it raise,
        in which phase?) goes into the one all-reduce of the step, so every rank commits, skips
        or raises together; before raising or skipping, the collectives the step's stages left
        in flight (``unsent``: ``(stage, stage half)``, e.g. TP's scatters) are waited for and
        dropped (``stage.abort``; every member issued them): the ranks' collectives stay paired.

        ``defer=True`` (``Muon._step`` decides it the same way on every rank: every commit is a
        collective-free select): the verdict stays on the device as a :class:`PendingVerdict`
        instead of being read here, also after a failure of this rank's own work (the others
        learn of it only from the votes, so this rank reports it when they do). The commit and
        AdamW select on it, :meth:`hold` keeps it and :meth:`settle` reads it at the next call
        that needs it: the host never waits for the step's kernels. Without collectives (one
        process, replicated data) a local failure has nobody to wait for and raises here.
        """
        check, self.check = self.check, None
        try:
            differ = self._grads_differ_across_ranks(check.params)
            if not differ and failure:  # nothing to agree on (one process, replicated data)
                raise failure[0][1]
            votes = self._send_votes(check.finite, failure, check.paths) if differ else None
            if defer and (votes is not None or check.finite is not None):
                ok = (votes.sum() == 0) if votes is not None else check.finite.all()
                return PendingVerdict(check, ok, votes, list(failure))
            commit = self._read_verdict(check, votes, failure)
        except BaseException:
            self._abort(unsent, check)
            raise
        if not commit:
            self._abort(unsent, check)
        return commit

    def hold(self, pending: PendingVerdict) -> None:
        """Keep a deferred verdict until :meth:`settle`, its votes and flags already on their
        way to the host (queued after the commit and AdamW that selected on it)."""
        pending.host = _OnHost([pending.votes, pending.check.finite])
        self.pending = pending

    @torch.compiler.disable  # the step's one host read, Python exceptions: eager
    def settle(self) -> bool:
        """Read the held verdict, if any: ``True`` (committed, or nothing held), ``False``
        (skipped: the commit and AdamW kept every old value; the skip warning goes out now), or
        the error that step would have raised (``FloatingPointError``, ``MuonStepError``),
        naming that step; its state is dropped either way. ``Muon`` calls it at the start of
        ``step()``, in ``state_dict()`` and in ``last_step_committed()``."""
        pending, self.pending = self.pending, None
        if pending is None:
            return True
        votes, finite = pending.host.wait() if pending.host else (pending.votes, None)
        pending.check.finite = finite
        try:
            commit = self._read_verdict(pending.check, votes, pending.failure, deferred=True)
        except BaseException:
            self._abort([], pending.check)
            raise
        if not commit:
            self._abort([], pending.check)
        return commit

    def drop(self) -> None:
        """Forget a held verdict unread (``load_state_dict`` replaces what it would change)."""
        self.pending = None

    def _send_votes(self, finite: Tensor | None, failure: list, paths=None) -> Tensor:
        """Shards and owners see different gradients and run different local work: every
        rank's votes (any non-finite gradient; the phase its local work failed in; any
        non-finite split NS result, so that the other ranks' error names it) summed by the
        step's one all-reduce, so no rank raises or skips while the others enter the next
        collective. Waited for on the stream, not read."""
        rank, world = dist.get_rank(), dist.get_world_size()
        votes = torch.zeros(world + 2, device=scalar_device())
        if finite is not None:
            votes[0:1].copy_((~finite.all()).reshape(1))
            split = [i for i, path in enumerate(paths or ()) if path == SPLIT]
            if split:
                votes[world + 1 :].copy_((~finite[split].all()).reshape(1))
        if failure:
            phase = failure[0][0]
            votes[1 + rank] = STEP_PHASES.index(phase) + 1 if phase in STEP_PHASES else -1
        C.wait(
            dist.all_reduce(votes, op=dist.ReduceOp.SUM, async_op=True),
            "Muon.step's agreement on non-finite gradients and failed ranks (all-reduce)",
            default_group(),
        )
        return votes

    def _read_verdict(
        self, check: _StepCheck, votes: Tensor | None, failure: list, deferred: bool = False
    ) -> bool:
        """The step's one host read: the local finite flags, or the all-reduced votes.
        ``deferred``: read one call after the step (:meth:`settle`), its gradients gone."""
        params, finite = check.params, check.finite
        bad: list[tuple] = []
        if votes is None:
            if finite is not None and not bool(finite.all()):  # one host sync per step
                bad = self._nonfinite_names(params, finite, check.paths, deferred)
        else:
            values = votes.tolist()  # one host sync per step
            failed = {
                r: STEP_PHASES[int(c) - 1] if c > 0 else "an unnamed phase"
                for r, c in enumerate(values[1:-1])
                if c != 0
            }
            if failed:
                raise _step_error(failed, failure, deferred)
            if values[0] > 0:
                bad = (
                    self._nonfinite_names(params, finite, check.paths, deferred)
                    if finite is not None and not bool(finite.all())
                    else []
                ) or [_elsewhere(values[-1] > 0)]
        if bad:
            message = _nonfinite_message(bad, skipping=self.opt.nonfinite_grads != "raise")
            if self.opt.nonfinite_grads == "raise":
                raise FloatingPointError(f"{_which_step(deferred)}: {message}")
            warnings.warn(
                f"{_which_step(deferred)} skipped: {message}", stacklevel=_user_stacklevel()
            )
            return False
        return True

    def _nonfinite_names(
        self, params: list[Tensor], finite: Tensor, paths: list | None = None, deferred=False
    ) -> list[tuple]:
        """``(name, what is not finite, kinds found, path)`` of each flagged parameter. Only on
        a non-finite step: its gradient and momentum buffer are read again to say which (read
        one call later, only the momentum buffer: the step left it unchanged)."""
        paths = paths or [READ] * len(params)
        part = self._nonfinite_part_later if deferred else self._nonfinite_part
        return [
            (self.opt.param_name(p), *part(p, path), path)
            for p, ok, path in zip(params, finite.tolist(), paths)
            if not ok
        ]

    def _nonfinite_part_later(self, p: Tensor, path: str) -> tuple[str, tuple]:
        """What was not finite, read one call after the step: the momentum buffer it left
        unchanged can be read again; the gradient is gone (a new backward, or ``zero_grad``)."""
        buf = self.opt.state.get(p, {}).get(MOMENTUM)
        if buf is not None and not _all_finite(buf):
            return MOMENTUM_BUFFER, (MOMENTUM_BUFFER,)
        if path == COMPILED:  # the flag is isfinite(‖g + μ·buf‖) and buf is finite
            return "gradient (or the norm of g + μ·buf past float32)", (GRADIENT,)
        if path == SPLIT:  # NaN from the gradient or from a split-group member's piece
            return "gradient, or a split-group member's piece of the Newton–Schulz result", ()
        return GRADIENT, (GRADIENT,)

    def _nonfinite_part(self, p: Tensor, path: str) -> tuple[str, tuple]:
        buf = self.opt.state.get(p, {}).get(MOMENTUM)
        found = tuple(
            kind
            for kind, t in ((GRADIENT, p.grad), (MOMENTUM_BUFFER, buf))
            if t is not None and not _all_finite(t)
        )
        if found:
            return " and ".join(found), found
        # Both finite: what overflowed depends on where the flag came from.
        if path == COMPILED:  # the flags are isfinite(‖u‖)
            what = "the compiled step's Newton–Schulz input g + μ·buf has a norm past float32"
        elif path == EAGER:
            what = "the eager step's Newton–Schulz returned NaN/Inf"
        elif path == SPLIT:
            what = (
                "the split Newton–Schulz returned NaN/Inf (a fault on a rank of the matrix's "
                "split group: its piece of the result was not finite)"
            )
        else:
            what = "a norm past float32"
        return f"gradient and momentum finite, but {what}", found

    def _abort(self, unsent: list, check: _StepCheck) -> None:
        """A step that does not commit: no state of its own left behind, the stages' collectives
        drained."""
        state = self.opt.state
        for p in check.fresh:
            state.pop(p, None)
        for stage, half in unsent:
            stage.abort(half)

    def _grads_differ_across_ranks(self, params: list[Tensor]) -> bool:
        if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
            return False
        from dmuon_compile.dedicated_registry import dedicated_names

        model = self.opt.model
        if model is not None and dedicated_names(model):
            return True
        groups = self.opt.param_groups
        return any(hasattr(p, "to_local") for group in groups for p in group["params"])
