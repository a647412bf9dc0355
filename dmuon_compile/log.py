"""Logging: rank-tagged progress lines and the ``TORCH_LOGS`` artifact of the compiler pass.

- :func:`rank_tag` gives ``[DMuon][rank=0/8]`` so startup stalls (autotune, compiles) are
  visible per rank in cluster logs.
- :func:`progress` prints such a line to stderr unless its environment switch is ``0`` (the
  SYRK autotune's per-rank lines: a stall there is one rank's).
- :func:`notice` makes such a line a ``logging`` record instead (the compiled step's "compiling
  the Muon step" and "ready" lines): INFO on rank 0, DEBUG on the others, so an application
  that shows INFO gets one line per job, not one per rank.
- ``logger`` is the ``dmuon_compile`` logger; ``TORCH_LOGS="+dmuon"`` (or ``"dmuon"``) turns it
  on through torch's logging system once :func:`register_torch_logs` ran (at import).
"""

from __future__ import annotations

import logging
import os
import sys

logger = logging.getLogger("dmuon_compile")


def rank_tag() -> str:
    """``[DMuon][rank=R/W]`` from torch.distributed (or RANK/WORLD_SIZE before init)."""
    rank, world = _rank_world()
    return f"[DMuon][rank={rank}/{world}]"


def _rank_world() -> tuple[int, int]:
    rank, world = 0, 1
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            rank, world = dist.get_rank(), dist.get_world_size()
        else:
            rank = int(os.environ.get("RANK", 0))
            world = int(os.environ.get("WORLD_SIZE", 1))
    except Exception:  # pragma: no cover - logging must never raise
        pass
    return rank, world


def env_flag(name: str, default: bool = True) -> bool:
    """Read a boolean environment switch: ``0/false/no/off`` → False (``env.flag``)."""
    from dmuon_compile.env import flag

    return flag(name, default)


def progress(message: str, switch: str | None = None) -> None:
    """Print a rank-tagged progress line to stderr (silenced when ``switch`` is set to 0)."""
    if switch is not None and not env_flag(switch, True):
        return
    print(f"{rank_tag()} {message}", file=sys.stderr, flush=True)


def notice(log: logging.Logger, message: str, *args, switch: str | None = None) -> None:
    """A notice of the package's own progress (a compile starting, its time) as a ``logging``
    record of ``log`` (a child of the ``dmuon_compile`` logger), tagged with the rank: INFO on
    rank 0, DEBUG on the other ranks; none when the environment ``switch`` is ``0``.

    Shown wherever the application shows the package's INFO records:
    ``logging.basicConfig(level=logging.INFO)``, or ``TORCH_LOGS="dmuon"`` (every rank's:
    ``TORCH_LOGS="+dmuon"``). ``message`` is a ``%``-format string of ``args``, as for
    ``Logger.info``.

    >>> notice(logger, "compiling the %s", "Muon step")
    """
    if switch is not None and not env_flag(switch, True):
        return
    level = logging.INFO if _rank_world()[0] == 0 else logging.DEBUG
    log.log(level, "%s " + message, rank_tag(), *args)


_TORCH_LOGS_NAME = "dmuon"


def register_torch_logs() -> None:
    """Register ``dmuon`` with ``torch._logging`` so ``TORCH_LOGS="+dmuon"`` controls it.

    Idempotent; called when ``dmuon_compile`` is imported. ``+dmuon`` is DEBUG (every rewrite,
    every skipped candidate, kernel sources), ``dmuon`` INFO (one summary per graph).

    ``import torch`` validates ``TORCH_LOGS`` before any third-party package runs, so
    ``TORCH_LOGS="+dmuon"`` set *before* Python starts needs the name to exist at that moment:
    the distribution's ``torch.backends`` entry point (``_dmuon_torch_logs.register``, a
    stdlib-only module outside this package) registers it during ``import torch`` when
    ``TORCH_LOGS`` mentions it, and imports nothing of ``dmuon_compile``. Without that entry
    point (a source checkout not installed with pip; ``TORCH_DEVICE_BACKEND_AUTOLOAD=0``), use
    the module name — ``TORCH_LOGS="+dmuon_compile"`` always works — or, in-process,
    ``torch._logging.set_logs(modules={"dmuon": logging.DEBUG})`` after importing the package.
    A ``TORCH_LOGS`` that mentions ``dmuon`` and was set in-process after ``import torch`` is
    re-applied here.

    >>> register_torch_logs()
    """
    from dmuon_compile._compat import TorchInternalsError, register_torch_log, reparse_torch_logs

    try:
        register_torch_log(_TORCH_LOGS_NAME, logger.name)
    except TorchInternalsError as exc:  # import must not fail: logging.getLogger still works
        logger.warning("%s", exc)
        return
    # TORCH_LOGS set in-process after `import torch` (tests, notebooks): torch parsed it once at
    # import; parse again now that the alias exists. Skipped when our logger was configured.
    setting = os.environ.get("TORCH_LOGS", "")
    mentions = any(part.strip().lstrip("+-") == _TORCH_LOGS_NAME for part in setting.split(","))
    if mentions and logger.level == logging.NOTSET and "torch._logging" in sys.modules:
        try:
            reparse_torch_logs()
        except Exception as exc:  # noqa: BLE001 - an invalid TORCH_LOGS elsewhere must not break import
            logger.warning("TORCH_LOGS=%r could not be applied: %s", setting, exc)
