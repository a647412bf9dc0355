"""The agreement between the two halves of a Muon step: every rank commits, skips or raises
together.

``Muon.step`` computes every matrix's update first (writing nothing), then calls
:meth:`StepAgreement._agree`: each rank's finite flags of its gradients and the phase in which
its local work failed, if it did, go into one all-reduce (no collective at all where every
rank sees the same gradients), and only then is anything written. A step that fails on one
rank therefore raises :class:`MuonStepError` on every rank and changes nothing anywhere; a
non-finite gradient raises ``FloatingPointError`` or skips the step (``nonfinite_grads``).
``Muon`` inherits these methods; they read its ``param_groups``, ``state``, ``model`` and
``nonfinite_grads``.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from dmuon_compile.distributed import _collectives as C
from dmuon_compile.distributed._c10d_compat import default_group
from dmuon_compile.distributed._collectives import scalar_device
from dmuon_compile.distributed._owned import local_of
from dmuon_compile.step_phases import PHASE_CHECK, STEP_PHASES, guarded

NONFINITE_MODES = ("raise", "skip")
# The skip warning names the user's ``opt.step()`` line: _read_verdict ← _agree or _settle ←
# torch.compiler.disable's wrapper ← Muon._step ← Muon.step ← torch.no_grad ← torch.optim's
# step hooks ← the caller (tests/test_deferred_verdict.py holds it, both ways).
_USER_FRAME = 8


class MuonStepError(RuntimeError):
    """Raised by ``Muon.step`` on every rank when the step failed on some rank (an exception
    in its local work: OOM, a compile or autotune error, ...). ``failed`` maps each failing rank
    to its phase; on a failing rank the original exception is the ``__cause__``. No weight and
    no optimizer state changed on any rank, and every rank left the same collectives behind:
    ``opt.zero_grad()`` on every rank and training goes on (the batch is skipped)."""

    def __init__(self, message: str, failed: dict[int, str]) -> None:
        super().__init__(message)
        self.failed = failed


@dataclass
class _StepCheck:
    """What ``Muon._prepare`` leaves for ``Muon._agree``, kept on the optimizer: never passed
    through a user-compiled step (the parameters are DTensors, the list lengths change after
    the first step: Dynamo would have to rebuild or guard them)."""

    params: list  # the parameters with gradients
    finite: Tensor | None  # their finite flags, on the device
    fresh: list  # those whose state this step created: dropped if the step does not commit
    tp: object = None  # the plan's TP stage: drops the scatters of a step that does not commit


@dataclass
class PendingVerdict:
    """A verdict left on the device by ``StepAgreement._agree(defer=True)``: ``ok`` (0-d bool)
    is what the commit selects on, ``StepAgreement._settle`` reads it after."""

    check: _StepCheck
    ok: Tensor  # commit or keep every old value
    votes: Tensor | None  # the all-reduced votes where ranks' gradients differ, else None


def _step_error(failed: dict[int, str], failure: list) -> MuonStepError:
    where = "; ".join(f"rank {r} in {phase}" for r, phase in sorted(failed.items()))
    own = failure[0][1] if failure else None
    cause = f": {type(own).__name__}: {own}" if own is not None else " (see that rank's error)"
    err = MuonStepError(
        f"Muon.step failed on {where}{cause}. Every rank raises this error at the same point; "
        "the step changed no weight and no optimizer state on any rank, and every rank issued "
        "the same collectives: call opt.zero_grad() on every rank and go on (the batch is "
        "skipped), or fix the cause on the failing rank.",
        dict(failed),
    )
    err.__cause__ = own
    return err


class StepAgreement:
    """``Muon``'s agreement methods (see the module docstring)."""

    @torch.compiler.disable  # host bookkeeping and a foreach norm: eager
    def _check_finite(self, checked: list, failure: list) -> None:
        """The step's finite flags, one per parameter with a gradient, kept in
        ``self._step_check`` in the order the verdict names them.

        ``checked``: ``(local gradients, flags)`` of the compiled halves, whose flags come
        from the norms Newton–Schulz takes of their Nesterov inputs (no extra read of the
        gradients); every other gradient (AdamW, eager, TP, a failed half) is read here by one
        ``foreach`` norm. A failure of that read is this rank's failure in
        ``PHASE_CHECK``.
        """
        check = self._step_check
        by_grad = {id(local_of(p.grad)): p for p in check.params}
        covered: list = []
        flags: list[Tensor] = []
        for grads, finite in checked:
            params = [by_grad.get(id(g)) for g in grads]
            # ``is``, not ``in``: ``None in params`` would call each tensor's ``__eq__`` (a
            # torch function per matrix on the step's host path).
            if all(p is not None for p in params):  # else read below with the rest
                covered += params
                flags.append(finite)
        taken = {id(p) for p in covered}
        rest = [p for p in check.params if id(p) not in taken]
        if rest:
            before = len(failure)
            read = guarded(
                failure, PHASE_CHECK, lambda: self._finite_flags([p.grad for p in rest]), None
            )
            if len(failure) > before:  # this rank's failure: the agreement raises it everywhere
                check.finite = None
                return
            flags.append(read)
        check.params = covered + rest
        if flags:
            device = flags[0].device
            check.finite = torch.cat([f.to(device).reshape(-1) for f in flags])

    def _finite_flags(self, grads: list[Tensor]) -> Tensor | None:
        """Per gradient: finite or not, on the device (read on the host by the agreement)."""
        if not grads:
            return None
        norms = torch._foreach_norm([local_of(g).float() for g in grads])
        return torch.isfinite(torch.stack([n.to(norms[0].device) for n in norms]))

    @torch.compiler.disable  # a collective, the step's one host read, Python exceptions: eager
    def _agree(self, failure: list, tp_halves: list, defer: bool = False) -> bool | PendingVerdict:
        """Between the two halves of the step: whether to commit (``False``: skip), or raise.

        Every rank's verdict on its gradients (finite?) and on its local work (did it raise,
        in which phase?) goes into the one all-reduce of the step, so every rank commits, skips
        or raises together; before raising or skipping, the TP scatters the step issued are
        waited for and dropped (every member issued them): the ranks' collectives stay paired.

        ``defer=True`` (``Muon._step`` decides: every commit is a compiled, collective-free
        select) and no local failure: the verdict stays on the device as a
        :class:`PendingVerdict` instead of being read here. The commit then writes
        ``where(ok, new, old)`` and :meth:`_settle` reads the verdict after the commit is
        enqueued, so the GPU is not left idle while the host launches the commit. The
        all-reduce (where ranks' gradients differ) is issued here either way: the collectives
        are the same whichever way a rank decides.
        """
        check, self._step_check = self._step_check, None
        try:
            differ = self._grads_differ_across_ranks(check.params)
            if not differ and failure:  # nothing to agree on (one process, replicated data)
                raise failure[0][1]
            votes = self._send_votes(check.finite, failure) if differ else None
            if defer and not failure and (votes is not None or check.finite is not None):
                ok = (votes.sum() == 0) if votes is not None else check.finite.all()
                return PendingVerdict(check, ok, votes)
            commit = self._read_verdict(check, votes, failure)
        except BaseException:
            self._abort(tp_halves, check)
            raise
        if not commit:
            self._abort(tp_halves, check)
        return commit

    @torch.compiler.disable  # the step's one host read, Python exceptions: eager
    def _settle(self, pending: PendingVerdict) -> bool:
        """The host read of a deferred verdict, after the commit that selected on it was
        enqueued: ``True`` (committed), ``False`` (skipped: the commit kept every old value),
        or the error ``_agree`` would have raised, with no weight or state changed."""
        try:
            commit = self._read_verdict(pending.check, pending.votes, [])
        except BaseException:
            self._abort([], pending.check)
            raise
        if not commit:
            self._abort([], pending.check)
        return commit

    def _send_votes(self, finite: Tensor | None, failure: list) -> Tensor:
        """Shards and owners see different gradients and run different local work: every
        rank's votes (any non-finite gradient; the phase its local work failed in) summed by
        the step's one all-reduce, so no rank raises or skips while the others enter the next
        collective. Waited for on the stream, not read."""
        rank, world = dist.get_rank(), dist.get_world_size()
        votes = torch.zeros(world + 1, device=scalar_device())
        if finite is not None:
            votes[0:1].copy_((~finite.all()).reshape(1))
        if failure:
            phase = failure[0][0]
            votes[1 + rank] = STEP_PHASES.index(phase) + 1 if phase in STEP_PHASES else -1
        C.wait(
            dist.all_reduce(votes, op=dist.ReduceOp.SUM, async_op=True),
            "Muon.step's agreement on non-finite gradients and failed ranks (all-reduce)",
            default_group(),
        )
        return votes

    def _read_verdict(self, check: _StepCheck, votes: Tensor | None, failure: list) -> bool:
        """The step's one host read: the local finite flags, or the all-reduced votes."""
        params, finite = check.params, check.finite
        bad: list[str] = []
        if votes is None:
            if finite is not None and not bool(finite.all()):  # one host sync per step
                bad = self._nonfinite_names(params, finite)
        else:
            values = votes.tolist()  # one host sync per step
            failed = {
                r: STEP_PHASES[int(c) - 1] if c > 0 else "an unnamed phase"
                for r, c in enumerate(values[1:])
                if c != 0
            }
            if failed:
                raise _step_error(failed, failure)
            if values[0] > 0:
                bad = (
                    self._nonfinite_names(params, finite)
                    if finite is not None and not bool(finite.all())
                    else []
                ) or ["a gradient held by another rank (see that rank's error)"]
        if bad:
            shown = ", ".join(bad[:8]) + (f" and {len(bad) - 8} more" if len(bad) > 8 else "")
            message = (
                f"non-finite (NaN/Inf) gradient in {shown} (for a compiled Muon step: in the "
                "gradient or its momentum buffer). Check whether AdamW alone shows the "
                "same NaN (then the cause is upstream: data, model, dtype); pass "
                "nonfinite_grads='skip' to skip such steps instead."
            )
            if self.nonfinite_grads == "raise":
                raise FloatingPointError("Muon.step: " + message)
            warnings.warn("Muon.step skipped: " + message, stacklevel=_USER_FRAME)
            return False
        return True

    def _nonfinite_names(self, params: list[Tensor], finite: Tensor) -> list[str]:
        return [self.param_name(p) for p, ok in zip(params, finite.tolist()) if not ok]

    def _abort(self, tp_halves: list, check: _StepCheck) -> None:
        """A step that does not commit: no state of its own left behind, TP scatters drained."""
        for p in check.fresh:
            self.state.pop(p, None)
        for half in tp_halves:
            if half is not None:
                check.tp.abort(half)

    def _grads_differ_across_ranks(self, params: list[Tensor]) -> bool:
        if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
            return False
        from dmuon_compile.dedicated_registry import dedicated_names

        if self.model is not None and dedicated_names(self.model):
            return True
        return any(hasattr(p, "to_local") for group in self.param_groups for p in group["params"])
