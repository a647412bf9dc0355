"""The phases of ``Muon.step`` that can fail on one rank only (named in ``MuonStepError``).

Below both the optimizer and the runtime (``MuonStepError`` names them; the TP phases are the
optimizer's work on the TP stage's gathered matrices, ``distributed/_stages/tp/stage.py``).
"""

from __future__ import annotations

# Where a step can fail on one rank only (owners differ per rank, and so do compiled graphs,
# autotune and memory peaks). The agreement all-reduce carries the position + 1; every rank
# names the failing rank and phase in the error it raises.
PHASE_STATE = "creating optimizer state"
PHASE_CHECK = "the gradient check (norms)"
PHASE_EAGER = "the eager Muon step (momentum, Newton–Schulz)"
PHASE_COMPILED = "the compiled Muon step (Dynamo trace, Inductor/Triton compile, autotune, run)"
PHASE_TP_MOMENTUM = "the TP momentum"
PHASE_TP_NS_EAGER = "the TP owners' Newton–Schulz (eager)"
PHASE_TP_NS_COMPILED = "the TP owners' Newton–Schulz (compiled: Dynamo, Inductor/Triton, autotune)"
PHASE_SPLIT_NS = "the split Newton–Schulz (a matrix orthogonalised by a group of ranks)"
PHASE_MASTERS = "the GPU memory for the offloaded masters' commit (offload='state')"
STEP_PHASES = (
    PHASE_STATE,
    PHASE_CHECK,
    PHASE_EAGER,
    PHASE_COMPILED,
    PHASE_TP_MOMENTUM,
    PHASE_TP_NS_EAGER,
    PHASE_TP_NS_COMPILED,
    PHASE_SPLIT_NS,
    PHASE_MASTERS,
)


def guarded(failure: list, phase: str, compute, placeholder):
    """``compute()``, or on an exception: ``(phase, exception)`` appended to ``failure`` and
    ``placeholder`` returned (``Muon.step``'s agreement then makes every rank raise)."""
    try:
        return compute()
    except Exception as err:  # noqa: BLE001 - re-raised on every rank by the agreement
        failure.append((phase, err))
        return placeholder
