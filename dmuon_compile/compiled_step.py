"""The compiled Muon step: per Muon group, one ``torch.compile(fullgraph=True)`` graph for the
directions (momentum → Newton–Schulz) and one small elementwise graph for the commit.

``CompiledMuonStep`` is what ``Muon`` dispatches to when ``compile`` is on (default on CUDA):
``torch.compile`` of :func:`dmuon_compile.functional.muon_directions`, the first half of the
function the eager step runs (the step is written once). One call computes, for every matrix of
the group, momentum → Newton–Schulz without writing any state, inside a single graph compiled
with the NS-chain pass
(:class:`dmuon_compile.passes.NSChainPass`), which rewrites the torch-primitive NS chain
(``mm``/``addmm``/``baddbmm``) into the symmetric ``torch.ops.dmuon`` kernels.

What keeps it to one graph and one compile:

- optimizer state is created eagerly by ``Muon._init_group`` before the call;
- ``momentum`` enters as a 0-d float32 tensor on the parameters' device, refilled in place
  every step: a schedule changes values, never guards, so it never recompiles (a Python float
  would be guarded by value); ``lr`` and ``weight_decay`` are used by the second half,
  ``functional.commit_muon_step``, which runs eagerly (elementwise ``foreach`` ops) after
  ``Muon.step``'s agreement across ranks;
- same-shape matrices are stacked and orthogonalised by one batched (``bmm``) chain
  (``functional.shape_buckets``, traced: shapes are static), bucket after bucket: Inductor
  frees a bucket's Nesterov inputs and Newton–Schulz work copies after their last use, so the
  graph holds the directions (its outputs) and one bucket's working set. It writes nothing, so
  no in-place update at the graph's end keeps every bucket's output alive: one graph suffices;
- the orthogonaliser is a copy of the group's that issues the torch-primitive chain
  (:func:`torch_chain`); the pass decides which products become ``torch.ops.dmuon`` kernels;
- each ``CompiledMuonStep`` compiles its own copy of the step function (a fresh code object),
  so several groups or optimizers never share — and exhaust — one Dynamo recompile budget;
- ``dynamic=False``: parameter shapes are static, and the pass matches static shapes.

NorMuon (``Muon(normuon=True)``, ``dmuon_compile/normuon.py``): the directions graph takes
the per-row second moments as inputs and returns the new ones beside the normalised
directions; the commit graph takes both and stores the new ones (with the momentum, under the
same ``commit_if`` select). Its β₂ and ε are a constant of the graph.

``mode="reduce-overhead"`` adds CUDA graphs (launch overhead dominates small matrices); it
marks gradients, momentum buffers and the momentum tensor as static
addresses, so gradients must be kept in place (``zero_grad(set_to_none=False)``). Calling a
``CompiledMuonStep`` runs both halves (the compiled graph, then the eager commit).

When the user compiles the optimizer step themselves (``opt.step = torch.compile(opt.step)``),
``Muon`` does not nest a second ``torch.compile``: it detects that Dynamo is tracing, installs
the NS-chain pass into ``torch._inductor.config.post_grad_custom_pre_pass`` (wrapping any pass
already there) at trace time, and ``muon_update`` is traced inline, so the user's graph gets
the same rewrite.

``Muon.compiled_steps`` caches the steps by :class:`StepKey` (group position, part).

Example::

    step = CompiledMuonStep(NewtonSchulz(backend="gram"))
    step(params, grads, bufs, lr=0.02, weight_decay=0.0, momentum=0.95, nesterov=True,
         adjust_lr_fn="match_rms_adamw")
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import logging
import time
import types
import warnings
from typing import NamedTuple

import torch
from torch import Tensor

from dmuon_compile import env
from dmuon_compile import functional as F
from dmuon_compile._compat import (
    compile_error_type,
    inductor_mode_options,
    mark_static_address,
    parse_version,
    post_grad_custom_pre_pass,
)
from dmuon_compile.log import notice, progress
from dmuon_compile.newton_schulz import NewtonSchulz

log = logging.getLogger("dmuon_compile.compiled_step")

COMPILE_MODES = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
_ids = itertools.count()


def check_compile_args(compile: bool | None, compile_mode: str | None) -> None:
    """Validate ``Muon(compile=..., compile_mode=...)`` with messages that name the value.

    >>> check_compile_args(None, "reduce-overhead")
    """
    if compile not in (None, True, False):
        raise TypeError(
            f"compile must be True, False or None (auto: True on CUDA), got {compile!r}"
        )
    if compile_mode not in COMPILE_MODES:
        raise ValueError(f"compile_mode={compile_mode!r}: choose one of {COMPILE_MODES}")
    if compile is False and compile_mode is not None:
        raise ValueError(
            f"compile_mode={compile_mode!r} needs compile=True (or None), got compile=False"
        )


def compile_enabled(compile: bool | None, params: list[Tensor]) -> bool:
    """``compile=None`` means: compile when the group's parameters are on CUDA."""
    if compile is not None:
        return bool(compile)
    return bool(params) and all(p.device.type == "cuda" for p in params)


class StepKey(NamedTuple):
    """The key of ``Muon.compiled_steps``: one compiled graph per key.

    ``group`` is the group's position in ``opt.param_groups``, not the dict:
    ``load_state_dict()`` replaces the group dicts, and a new step would compile the same graph
    again. ``part`` is ``"all"``, or with HSDP ``"early"``/``"rest"`` (the group is stepped in
    two subsets, the first forward group's matrices first), or ``"tp"`` (the TP owners'
    Newton–Schulz, :meth:`CompiledMuonStep.orthogonalize`).
    """

    group: int
    part: str = "all"


def torch_chain(ns: NewtonSchulz) -> NewtonSchulz:
    """A copy of ``ns`` that issues plain ``mm``/``addmm``/``baddbmm`` (the graph the pass
    matches)."""
    if ns.kernel == "cublas":
        return ns
    chain = copy.copy(ns)
    chain.kernel = "cublas"
    return chain


def _fresh_copy(fn):
    """A copy of ``fn`` with its own code object: Dynamo keeps caches per code object."""
    n = next(_ids)
    code = fn.__code__.replace(co_name=f"{fn.__name__}_{n}")
    if hasattr(code, "co_qualname"):
        code = code.replace(co_qualname=f"{fn.__qualname__}_{n}")
    copied = types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)
    copied.__kwdefaults__ = fn.__kwdefaults__
    return copied


def default_compile_options(mode: str | None = None, rewrite: bool = True) -> dict:
    """Inductor options of the compiled step: the NS-chain pass (wrapping a user's pass), one
    elementwise launch config, the mode's options (``torch.compile`` takes ``mode`` or
    ``options``, not both), and the torch-2.11 workaround for pytorch#176591 (loop reordering
    across 2-D/3-D recompiles). ``rewrite=False`` keeps the NS-chain pass out, also one
    installed globally.

    >>> "post_grad_custom_pre_pass" in default_compile_options()
    True
    """
    from dmuon_compile.passes import NSChainPass, compile_options

    # One launch config per 1-D elementwise kernel instead of timing several at the first run:
    # the step's elementwise work is a small share of its GPU time, and timing its hundreds of
    # kernels costs seconds of a cold first step. Max-autotune modes still tune.
    options: dict = {"triton.autotune_pointwise": False}
    if mode not in (None, "default"):
        options.update(inductor_mode_options(mode))
    if parse_version(torch.__version__) < (2, 13):
        options["loop_ordering_after_fusion"] = False
    if rewrite:
        return compile_options(options)
    current = post_grad_custom_pre_pass()
    if isinstance(current, NSChainPass):
        # Installed globally for a user-compiled step: without this, a kernel="cublas" step
        # compiled later in the process would still get the rewrite. The user's pass stays.
        options["post_grad_custom_pre_pass"] = current.user_pass
    return options


def pass_enabled(ns: NewtonSchulz) -> bool:
    """Whether the compiled step rewrites the NS chain into ``torch.ops.dmuon`` kernels:
    :func:`dmuon_compile.kernel_choice.choose_kernel`'s ``site="step"`` rule.

    Yes when the orthogonaliser resolved to the Triton kernels, and on a machine without CUDA
    (the ops run their torch reference: how the pass is tested without a GPU). No for an
    explicit ``kernel="cublas"`` / ``deterministic=True`` (that choice means plain cuBLAS in
    the compiled step too: the documented way to isolate a suspected SYRK kernel), and no for
    GPUs without the Triton kernels.
    """
    from dmuon_compile.kernel_choice import choose_kernel

    return choose_kernel("step", requested=ns.requested_kernel, resolved=ns.kernel).uses_op


class CompiledMuonStep:
    """The compiled step of one Muon group (see the module docstring).

    Args:
        ns: the group's ``NewtonSchulz``; the compiled graph uses its torch-primitive chain.
        mode: ``None``/``"default"``, ``"reduce-overhead"`` (CUDA graphs), ``"max-autotune"``…
        options: extra Inductor options, merged over :func:`default_compile_options`.

    Example::

        step = CompiledMuonStep(ns, mode="reduce-overhead")
        step(params, grads, bufs, lr=lr, weight_decay=0.0, momentum=0.95, nesterov=True,
             adjust_lr_fn="match_rms_adamw")
    """

    def __init__(
        self, ns: NewtonSchulz, mode: str | None = None, options: dict | None = None
    ) -> None:
        check_compile_args(True, mode)
        self.ns = ns
        self.chain = torch_chain(ns)  # one object: Dynamo guards on it, never rebuilt
        self.mode = mode
        self.rewrites = pass_enabled(ns)
        opts = default_compile_options(mode, rewrite=self.rewrites)
        opts.update(options or {})
        self.options = opts
        self.fn = torch.compile(
            _fresh_copy(F.muon_directions), fullgraph=True, dynamic=False, options=opts
        )
        # The second half (momentum and update, elementwise) in a graph of its own: Inductor
        # fuses it into a few kernels where eager takes several launches per matrix. No CUDA
        # graph (its inputs are the first graph's outputs) and no NS pass (it has no NS).
        self._commit = torch.compile(
            _fresh_copy(F.commit_muon_step),
            fullgraph=True,
            dynamic=False,
            options=default_compile_options(None, rewrite=False),
        )
        self._commit_eager = False  # the compiled commit failed to compile: the eager one
        self._orthogonalize = None  # compiled on first use: TP owners' NS (``orthogonalize``)
        self._hypers: dict[tuple[str, torch.device], Tensor] = {}
        self._static_marked: set[int] = set()
        self.calls = 0
        self.first_call_s: float | None = None

    def hyper_tensor(
        self, device: torch.device, value: float | Tensor, name: str = "momentum"
    ) -> Tensor:
        """The 0-d float32 tensor of hyper-parameter ``name`` on ``device``, refilled in place
        (a value change never recompiles: Dynamo guards a Python float by value)."""
        t = self._hypers.get((name, device))
        if t is None:
            t = self._hypers[(name, device)] = torch.zeros((), dtype=torch.float32, device=device)
        if isinstance(value, Tensor) and value.device.type != "cpu":
            t.copy_(value.detach().reshape(()))  # on device: no host sync
        else:  # a float, or a CPU tensor: a host read, no H2D copy
            t.fill_(float(value))
        return t

    def __call__(
        self,
        params,
        grads,
        bufs,
        *,
        lr,
        weight_decay,
        momentum,
        nesterov,
        adjust_lr_fn,
        layouts=None,
        second_moments=None,
        normuon=None,
    ) -> None:
        """The whole step: :meth:`directions`, then :meth:`commit` (``second_moments``,
        ``normuon``: NorMuon's, updated in place)."""
        ortho = self.directions(
            grads,
            bufs,
            momentum=momentum,
            nesterov=nesterov,
            layouts=layouts,
            second_moments=second_moments,
            normuon=normuon,
        )
        new_moments = None
        if second_moments is not None:
            ortho, new_moments = ortho
        self.commit(
            params,
            grads,
            bufs,
            ortho,
            lr=lr,
            weight_decay=weight_decay,
            momentum=momentum,
            adjust_lr_fn=adjust_lr_fn,
            layouts=layouts,
            second_moments=second_moments,
            new_second_moments=new_moments,
        )

    def commit(
        self,
        params,
        grads,
        bufs,
        ortho,
        *,
        lr,
        weight_decay,
        momentum,
        adjust_lr_fn,
        commit_if: Tensor | None = None,
        layouts=None,
        second_moments=None,
        new_second_moments=None,
    ):
        """``functional.commit_muon_step`` compiled: buf ← μ·buf + g and the weight update, in
        place (after ``Muon.step``'s agreement); hyper-parameters as 0-d device tensors.
        ``commit_if``: a verdict still on the device (each value written as
        ``where(commit_if, new, old)``; one more compiled graph than without).
        ``second_moments`` ← ``new_second_moments``: NorMuon's, from :meth:`directions`."""
        if not params:
            return
        device = params[0].device
        if commit_if is not None:
            commit_if = commit_if.to(device, non_blocking=True)
        lr_t = self.hyper_tensor(device, lr, "lr")
        wd_t = self.hyper_tensor(device, weight_decay, "weight_decay")
        mu_t = self.hyper_tensor(device, momentum, "momentum")
        args = (list(params), list(grads), list(bufs), list(ortho))
        kwargs = dict(
            lr=lr_t,
            weight_decay=wd_t,
            momentum=mu_t,
            adjust_lr_fn=adjust_lr_fn,
            commit_if=commit_if,
            layouts=None if layouts is None else tuple(layouts),
            second_moments=None if second_moments is None else list(second_moments),
            new_second_moments=None if new_second_moments is None else list(new_second_moments),
        )
        if self._commit_eager:
            F.commit_muon_step(*args, **kwargs)
            return
        try:
            self._commit(*args, **kwargs)
        except compile_error_type() as exc:
            # The commit runs after the step's verdict: raising here would leave the job's
            # other commits written and this one not, on this rank only. Compiling writes
            # nothing, so the eager reference commits instead, now and from here on.
            self._commit_eager = True
            warnings.warn(
                f"dmuon_compile: the compiled Muon commit failed to compile "
                f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); "
                "this and later commits of this group run the eager reference (the same "
                "math, several kernels per matrix). Muon(compile=False) skips compiling; "
                "TORCH_LOGS=dynamo,inductor shows the failure.",
                RuntimeWarning,
                stacklevel=2,
            )
            F.commit_muon_step(*args, **kwargs)

    def directions(
        self,
        grads,
        bufs,
        *,
        momentum,
        nesterov,
        finite_flags: bool = False,
        layouts=None,
        second_moments=None,
        normuon=None,
        keep_momentum: bool = False,
    ):
        """``functional.muon_directions`` in the compiled graph: NS(u) of every matrix, no
        state written (``Muon.step`` agrees across ranks, then commits). ``finite_flags=True``
        returns ``(directions, flags)``: each matrix's finite flag from the norm NS takes
        anyway (``Muon.step``'s gradient check for these matrices, at no extra read).
        ``second_moments`` (NorMuon; ``normuon``: its ``NorMuon`` hyper-parameters): the
        directions normalised per row, and the new moments after them. ``keep_momentum``:
        each matrix's buf′ returned last (``Muon(keep_new_momentum=True)``)."""
        if not grads:
            out = ([], None) if finite_flags else ([],)  # as muon_directions returns
            out += (() if second_moments is None else ([],)) + (([],) if keep_momentum else ())
            return out if len(out) > 1 else []
        devices = {g.device for g in grads}
        if len(devices) != 1:
            raise ValueError(
                "the compiled Muon step needs one device per group, got "
                f"{sorted(map(str, devices))}"
            )
        device = next(iter(devices))
        mu_t = self.hyper_tensor(device, momentum)
        if self.mode == "reduce-overhead":
            self._mark_static(list(grads) + list(bufs) + list(second_moments or ()) + [mu_t])
        with self._first_call("Muon step", grads, layouts):
            return self.fn(
                list(grads),
                list(bufs),
                momentum=mu_t,
                nesterov=bool(nesterov),
                ns=self.chain,
                finite_flags=finite_flags,
                layouts=None if layouts is None else tuple(layouts),  # constants: no guard churn
                second_moments=None if second_moments is None else list(second_moments),
                normuon=normuon,
                keep_momentum=bool(keep_momentum),
            )

    @contextlib.contextmanager
    def _first_call(self, name: str, mats, layouts=None):
        """Counts a call (when it returns); the first one (trace + compile + run: tens of
        seconds on big models) is announced before and after, with its time, as logging
        records (``log.notice``: INFO on rank 0, DEBUG on the other ranks)."""
        if self.calls > 0:
            yield
            self.calls += 1
            return
        # Logging records (``log.notice``: INFO on rank 0, DEBUG on the others), not prints.
        buckets = len(F.shape_buckets(mats, layouts))
        notice(
            log,
            "compiling the %s (%d matrices, %d shape bucket(s)); DMUON_COMPILE_LOG=0 silences this",
            name,
            len(mats),
            buckets,
            switch=env.COMPILE_LOG,
        )
        start = time.perf_counter()
        yield
        self.calls += 1
        self.first_call_s = time.perf_counter() - start
        notice(
            log,
            "compiled %s ready: first call (trace + compile + run) took %.1f s for %d matrices "
            "in %d shape bucket(s)",
            name,
            self.first_call_s,
            len(mats),
            buckets,
            switch=env.COMPILE_LOG,
        )

    def orthogonalize(self, mats: list[Tensor], layouts=None) -> list[Tensor]:
        """Newton–Schulz of whole matrices in one compiled graph with this step's options and
        pass: the TP owners' part of a step (``distributed/_stages/tp/stage.py`` gathers the shards
        before and scatters the result after; momentum and the update run on the shards).
        ``layouts``: each matrix's (blocked: per head), constants of the graph."""
        if self._orthogonalize is None:
            self._orthogonalize = torch.compile(
                _fresh_copy(F.orthogonalize), fullgraph=True, dynamic=False, options=self.options
            )
        with self._first_call("TP owners' Newton–Schulz", mats):
            return self._orthogonalize(list(mats), self.chain, layouts=layouts)

    def _mark_static(self, tensors) -> None:
        for t in tensors:
            if id(t) not in self._static_marked:
                mark_static_address(t)
                self._static_marked.add(id(t))


@torch.compiler.assume_constant_result
def _install_pass_while_tracing() -> bool:
    """Runs at Dynamo trace time (not in the graph): Inductor reads the global pass later.

    Says so once per process: the user's first compiled step is where the trace, Inductor and
    the SYRK autotune of new shapes spend their time.
    """
    from dmuon_compile.passes import install_global_pass

    global _announced_user_trace
    if not _announced_user_trace:
        _announced_user_trace = True
        progress(
            "tracing the Muon step into your torch.compile graph (the NS-chain pass rewrites its "
            "Newton–Schulz products; the first call compiles); DMUON_COMPILE_LOG=0 silences this",
            switch=env.COMPILE_LOG,
        )
    install_global_pass()
    return True


_announced_user_trace = False


def compiled_step_for(opt, group: dict, params, part: str = "all") -> CompiledMuonStep | None:
    """The ``CompiledMuonStep`` that runs this group's Muon math, or ``None`` for the eager calls
    of ``functional.muon_directions`` and ``commit_muon_step`` (``Muon._directions`` and
    the commit dispatch on it).

    - traced by the user's ``torch.compile`` (``opt.step = torch.compile(opt.step)``): install
      the NS-chain pass globally (at trace time) and return ``None``: the step's functional
      halves are traced into the user's graph and the pass rewrites it there, as in our own
      compiled step;
    - ``opt.compile`` on (default on CUDA): the step cached in ``opt.compiled_steps`` under
      ``StepKey(group position, part)``, created on first use (again if ``opt.ns`` or
      ``opt.compile_mode`` was replaced since);
    - otherwise ``None``.
    """
    if torch.compiler.is_compiling():
        _install_pass_while_tracing()
        return None
    if not compile_enabled(opt.compile, params):
        return None
    key = StepKey(next(i for i, g in enumerate(opt.param_groups) if g is group), part)
    step = opt.compiled_steps.get(key)
    if step is None or step.ns is not opt.ns or step.mode != opt.compile_mode:
        step = opt.compiled_steps[key] = CompiledMuonStep(opt.ns, mode=opt.compile_mode)
    return step
