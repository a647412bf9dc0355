"""QK-clip (MuonClip): after each optimizer step, the attention heads whose largest
pre-softmax logit ``q·kᵀ·scale`` in the forward since the last step exceeded ``tau`` get their
query and key weights scaled so that logit comes back to ``tau``.

With ``γ_h = tau / max_h`` for a head ``h`` whose max exceeded ``tau`` (1 for every other head):

- multi-head attention (as many kv heads as q heads): the head's ``W_q`` rows and ``W_k``
  rows each times ``√γ_h``;
- grouped-query attention (a kv head shared by several q heads): the q head's rows times
  ``γ_h``, ``W_k`` untouched. A shared key serves heads with different maxima; scaling it would
  move the logits of the group's other heads too. On ``q`` alone the factor is exact per head:
  each clipped head's max becomes ``tau``, every other head keeps its logits bit for bit;
- multi-head latent attention (DeepSeek-V2/V3): per head, the q nope rows and the k nope rows
  of the kv up-projection times ``√γ_h``, the q rope rows times ``γ_h``; the shared rope key
  (the kv down-projection's rope rows) and v are left alone.

A fused ``wqkv`` scales its q and k rows by these rules, in its row order: ``[q; k; v]``, or
per kv head (its q heads, its k, its v) in torchtitan's ``FusedQKVLinear``.
Biases of the scaled projections get their rows' factors (``q`` and ``k`` scale exactly).
The logit is linear in ``W_q`` and in ``W_k`` (RoPE rotates within a head), so after the clip
the same batch's max logit of every head is ``≤ tau``. A QK-norm after the projections
(``q_norm``/``k_norm``) would undo the scaling: such modules raise instead.

Collection, automatic inside each recognised attention module's forward (training mode),
from the ``q`` and ``k`` the kernel gets, never the whole score matrix:

- ``torch.nn.functional.scaled_dot_product_attention``: seen by a ``TorchFunctionMode``;
  :func:`~dmuon_compile.qk_logits.max_logits` (causal and ``attn_mask`` honoured);
- FlexAttention: torchtitan's ``FlexAttention`` wrapper through a forward pre-hook (its q, k,
  ``BlockMask``, ``score_mod``, ``scale``), any other ``flex_attention(...)`` call (compiled or
  not) through the same mode, which sees the ``flex_attention`` higher-order op the Python
  function calls (the function itself is no torch function). The wrapper's hook comes first
  where it applies: it runs in the model's own mode instead of being traced into torchtitan's
  compiled kernel region, and the op inside it is then skipped.
  :func:`~dmuon_compile.qk_logits.max_logits_flex`: the block mask's ``mask_mod`` and block
  sparsity honoured as the kernel honours them; the logit is the raw ``q·kᵀ·scale`` (MuonClip's,
  the one the scaling moves linearly), a ``score_mod`` only leaves out the positions it sends
  to ``-inf``.

Both take FlexAttention's fused max scores on CUDA, else query blocks in fp32. Any other
kernel hands its maxima over with :meth:`QKClip.observe`; a recognised module whose forwards
recorded nothing warns once. At :meth:`QKClip.apply` all layers' maxima are packed in one
tensor and reduced with one ``all_reduce(MAX)`` over ``group``: every rank scales by the same
maxima.

Example::

    clip = dmuon.QKClip(model, tau=100.0).attach(opt)  # runs after every opt.step()
"""

from __future__ import annotations

import contextlib
import math
import sys
import threading
import warnings
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from dmuon_compile import _compat
from dmuon_compile.layouts import (
    HEAD_COUNT_ATTRS,
    MLA_KV_PROJECTIONS,
    MLA_Q_PROJECTIONS,
    config_count,
    head_layouts,
)
from dmuon_compile.qk_logits import max_logits, max_logits_flex, max_logits_of_flex_call

# Norms after the q/k projections that undo a weight scaling (Qwen3, OLMo2, torchtitan).
_QK_NORMS = ("q_norm", "k_norm", "q_layernorm", "k_layernorm")
_STATE_KEY = "qk_clip"


# ---------------------------------------------------------------------- the attention modules
@dataclass
class _Rows:
    """How one projection's rows scale: row ``r`` by ``γ[head[r]] ** power[r]``."""

    fqn: str
    owner: nn.Module  # the nn.Linear (or holder) whose ``weight``/``bias`` these rows are
    head: Tensor  # int64 (rows,)
    power: Tensor  # float64 (rows,): 0 (untouched), 0.5 or 1


@dataclass
class _Attention:
    """One recognised attention module: its heads and the projections QK-clip scales."""

    name: str
    module: nn.Module
    n_heads: int
    # (q weight rows, q heads) of the smallest whole piece a TP shard holds: one head's rows,
    # or one kv group of torchtitan's fused wqkv (a shard's first head from its first row)
    unit: tuple[int, int]
    q_owner: nn.Module  # holds the q weight: a TP shard's first head from its rows
    rows: list[_Rows]
    running: Tensor | None = None  # per-head max since the last apply (this rank)
    forwards: int = 0  # eager forwards in training mode since the last apply
    records: int = 0  # maxima recorded (SDPA calls, observe) since the last apply
    modes: list = field(default_factory=list)  # the collecting modes of running forwards
    # a record made inside a compiled region (not counted) was seen: no "nothing seen" warning
    traced: bool = False


def _head_rows(n_heads: int, parts) -> tuple[Tensor, Tensor]:
    """Rows of ``n_heads`` heads, each ``parts`` = ``[(size, power), ...]`` one after the
    other: ``(head, power)`` per row."""
    per_head = sum(size for size, _ in parts)
    head = torch.arange(n_heads).repeat_interleave(per_head)
    power = torch.cat([torch.full((size,), float(p), dtype=torch.float64) for size, p in parts])
    return head, power.repeat(n_heads)


def _attentions(model: nn.Module) -> list[_Attention]:
    """The attention modules :func:`~dmuon_compile.layouts.head_layouts` recognises, with the
    rows QK-clip scales (the module docstring's rules)."""
    layouts = head_layouts(model)
    modules = dict(model.named_modules())
    by_module: dict[str, dict[str, str]] = {}
    for fqn in layouts:
        path, _, proj = fqn[: -len(".weight")].rpartition(".")
        if path.rpartition(".")[2] == "qkv_linear":  # torchtitan's holder of wq/wk/wv or wqkv
            path = path.rpartition(".")[0]
        by_module.setdefault(path, {})[proj] = fqn
    found = []
    for path, projs in by_module.items():
        module, prefix = modules[path], f"{path}." if path else ""
        kv = next((n for n in MLA_KV_PROJECTIONS if n in projs), None)
        if kv is not None:
            found.append(_mla(path, prefix, module, projs, kv))
        else:
            found.append(_plain(path, prefix, module, projs, layouts))
    return found


def _sub(module: nn.Module, fqn: str, prefix: str) -> nn.Module:
    return module.get_submodule(fqn[len(prefix) : -len(".weight")])


def _mla(path: str, prefix: str, module: nn.Module, projs: dict, kv: str) -> _Attention:
    nope = config_count(module, ("qk_nope_head_dim",))
    rope = config_count(module, ("qk_rope_head_dim",))
    v_dim = config_count(module, ("v_head_dim",))
    n_heads = config_count(module, HEAD_COUNT_ATTRS)
    q = next((n for n in MLA_Q_PROJECTIONS if n in projs), None)
    if q is None:
        raise ValueError(
            f"QKClip: the MLA module {path!r} has no q up-projection {MLA_Q_PROJECTIONS}"
        )
    q_owner = _sub(module, projs[q], prefix)
    rows = [_Rows(projs[q], q_owner, *_head_rows(n_heads, [(nope, 0.5), (rope, 1)]))]
    kv_owner = _sub(module, projs[kv], prefix)
    rows.append(_Rows(projs[kv], kv_owner, *_head_rows(n_heads, [(nope, 0.5), (v_dim, 0)])))
    return _Attention(path, module, n_heads, (nope + rope, 1), q_owner, rows)


def _plain(path: str, prefix: str, module: nn.Module, projs: dict, layouts: dict) -> _Attention:
    norms = [n for n in _QK_NORMS if isinstance(getattr(module, n, None), nn.Module)]
    if any(not isinstance(getattr(module, n), nn.Identity) for n in norms):
        raise ValueError(
            f"QKClip: the attention module {path!r} normalises q and k after their projections "
            f"({', '.join(norms)}): scaling W_q and W_k does not change its logits (its QK-norm "
            "already bounds them). Leave QK-clip off for this model"
        )
    q_name = next(p for p in ("wqkv", "q_proj", "wq") if p in projs)
    q_owner = _sub(module, projs[q_name], prefix)
    if q_name == "wqkv":
        q_part, kv_part, _ = layouts[projs[q_name]].parts
        n_heads = config_count(module, HEAD_COUNT_ATTRS)
        head_dim = q_part // n_heads
        n_kv = kv_part // head_dim
    else:
        head_dim = layouts[projs[q_name]].head_dims[0]
        k_name = "k_proj" if q_name == "q_proj" else "wk"
        n_heads = q_owner.weight.shape[0] // head_dim
        n_kv = _sub(module, projs[k_name], prefix).weight.shape[0] // head_dim
    if n_kv <= 0 or n_heads % n_kv:
        raise ValueError(f"QKClip: {path!r} has {n_heads} q heads and {n_kv} kv heads")
    mha = n_kv == n_heads  # MHA: √γ on q and k; GQA: γ on q, k untouched
    q_power, k_power = (0.5, 0.5) if mha else (1.0, 0.0)
    unit = (head_dim, 1)
    if q_name == "wqkv" and _grouped_qkv(module):
        head, power = _grouped_rows(n_heads, n_kv, head_dim, q_power, k_power)
        rows = [_Rows(projs[q_name], q_owner, head, power)]
        unit = ((n_heads // n_kv + 2) * head_dim, n_heads // n_kv)
    elif q_name == "wqkv":  # [q; k; v]
        q_rows = _head_rows(n_heads, [(head_dim, q_power)])
        k_rows, v_rows = (_head_rows(n_kv, [(head_dim, p)]) for p in (k_power, 0.0))
        head, power = (torch.cat(parts) for parts in zip(q_rows, k_rows, v_rows))
        rows = [_Rows(projs[q_name], q_owner, head, power)]
    else:
        rows = [_Rows(projs[q_name], q_owner, *_head_rows(n_heads, [(head_dim, q_power)]))]
        if mha:
            k_rows = _head_rows(n_kv, [(head_dim, k_power)])
            rows.append(_Rows(projs[k_name], _sub(module, projs[k_name], prefix), *k_rows))
    return _Attention(path, module, n_heads, unit, q_owner, rows)


def _grouped_qkv(module: nn.Module) -> bool:
    """Whether the fused ``wqkv`` under ``module.qkv_linear`` is torchtitan's
    ``FusedQKVLinear``, which stores its rows by kv head (``[q heads of kv head 0; k 0; v 0;
    q heads of kv head 1; ...]``, so that a column-parallel shard holds whole groups), not
    ``[q; k; v]``."""
    holder = getattr(module, "qkv_linear", None)
    return isinstance(getattr(holder, "heads_per_kv", None), int) and hasattr(holder, "r_dim")


def _grouped_rows(n_heads: int, n_kv: int, head_dim: int, q_power: float, k_power: float):
    """``(head, power)`` per row of torchtitan's grouped ``wqkv``: per kv head ``g``, its
    ``n_heads // n_kv`` q heads, then its k (the group's first q head: under MHA the group's
    only one; under GQA its power is 0), then its v (power 0)."""
    per = n_heads // n_kv
    q_head = torch.arange(n_heads).view(n_kv, per)
    kv_head = (torch.arange(n_kv) * per).view(n_kv, 1).expand(n_kv, 2)
    head = torch.cat([q_head, kv_head], 1).repeat_interleave(head_dim, 1).reshape(-1)
    power = torch.tensor([q_power] * per + [k_power, 0.0], dtype=torch.float64)
    return head, power.repeat_interleave(head_dim).repeat(n_kv)


# ---------------------------------------------------------------------- shards
def _dtensor_type():
    """DTensor, or ``None`` when ``torch.distributed.tensor`` was never imported (then no
    tensor is one, and this module does not import it)."""
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None)


def _local(t: Tensor) -> Tensor:
    """A DTensor's local tensor (q/k of TP without local outputs: this rank's heads)."""
    dtensor = _dtensor_type()
    return t.to_local() if dtensor is not None and isinstance(t, dtensor) else t


def _local_rows(t: Tensor, name: str) -> tuple[Tensor, int, int]:
    """``(local tensor, first global row, stop)`` of ``t``: a plain tensor is all its rows; a
    DTensor replicated or sharded along its rows (``Shard(0)`` on any mesh dims: FSDP2, TP
    column-parallel q/k, a dedicated weight's owner mesh) its local rows; anything else raises."""
    dtensor = _dtensor_type()
    if dtensor is None or not isinstance(t, dtensor):
        return t, 0, t.shape[0]
    local = t.to_local()
    if local.numel() == 0:  # a rank outside the mesh (a dedicated weight off its owner)
        return local, 0, 0
    start, stop = 0, t.shape[0]
    coordinate = t.device_mesh.get_coordinate()
    for dim, placement in enumerate(t.placements):
        if placement.is_replicate():
            continue
        # exactly Shard(0): _StridedShard (FSDP2 over TP) orders its rows otherwise
        if type(placement).__name__ != "Shard" or placement.dim != 0:
            raise ValueError(
                f"QKClip: {name} is a DTensor placed {tuple(t.placements)}: QK-clip scales rows "
                "and supports plain tensors, dedicated weights (dmuon.dedicate_params), FSDP2 "
                "Shard(0) and tensor-parallel Shard(0) (column-parallel q/k). Shard the q/k "
                "projections along their rows, or dedicate them"
            )
        chunk = -(-(stop - start) // t.device_mesh.size(dim))  # torch.chunk's, as DTensor
        first = min(start + coordinate[dim] * chunk, stop)
        start, stop = first, min(first + chunk, stop)
    if local.shape[0] != stop - start:
        raise ValueError(
            f"QKClip: {name}'s local shard has {local.shape[0]} rows, its placements "
            f"{tuple(t.placements)} say {stop - start}: shard the q/k projections evenly"
        )
    return local, start, stop


# ---------------------------------------------------------------------- collection
class _Collect(TorchFunctionMode):
    """Active inside one attention module's forward: sees its SDPA calls and its FlexAttention
    kernel calls (the ``flex_attention`` higher-order op: the Python function
    ``flex_attention`` is no torch function, the op it calls dispatches to torch function
    modes, eagerly and, since torch 2.9, inside Dynamo's trace too; ``flex_attention`` always
    compiles its op, so a flex record is made in a trace)."""

    def __init__(self, clip: QKClip, attention: _Attention) -> None:
        super().__init__()
        self.clip, self.attention = clip, attention
        self.wrapped = 0  # inside a FlexAttention wrapper whose pre-hook recorded: skip its op

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            self.clip._record_sdpa(self.attention, args, kwargs)
        elif func is self.clip.flex_op and not self.wrapped:
            self.clip._record_flex_call(self.attention, args, kwargs)
        return func(*args, **kwargs)


def _flex_op():
    """FlexAttention's higher-order op (``None`` on a torch without one)."""
    try:
        import torch.nn.attention.flex_attention  # noqa: F401 - registers the op

        return getattr(torch.ops.higher_order, "flex_attention", None)
    except (ImportError, AttributeError, RuntimeError):
        return None


def _flex_wrappers(module: nn.Module) -> list[nn.Module]:
    """torchtitan's ``FlexAttention`` modules under ``module`` (none when torchtitan was never
    imported: then no module is one)."""
    titan = sys.modules.get("torchtitan.models.common.attention")
    cls = getattr(titan, "FlexAttention", None)
    return [] if cls is None else [m for m in module.modules() if isinstance(m, cls)]


_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale")

_PAUSED = threading.local()  # depth of not_collecting() blocks on this thread


@contextlib.contextmanager
def not_collecting():
    """No QK-clip collects inside this block (forwards that are no training step's: torch's
    pipeline stages run one on empty tensors to infer shapes, which every ``QKClip`` keeps out
    this way)."""
    _PAUSED.depth = getattr(_PAUSED, "depth", 0) + 1
    try:
        yield
    finally:
        _PAUSED.depth -= 1


# ---------------------------------------------------------------------- the clip
def model_groups(model: nn.Module) -> list | None:
    """The process groups whose product holds ``model`` (a pipeline stage's part): its
    dedicated runtime's mesh dimensions, HSDP's replicate mesh and the TP group; ``None``
    without a runtime (the default group then)."""
    from dmuon_compile.dedicated_registry import runtime_of

    runtime = runtime_of(model)
    if runtime is None:
        return None
    groups = list(runtime.mesh.get_all_groups())
    if runtime.replicate_mesh is not None:
        groups += runtime.replicate_mesh.get_all_groups()
    if runtime.tp is not None:
        groups.append(runtime.tp.pg)
    return groups


class QKClip:
    """QK-clip of every attention module of ``model`` that
    :func:`~dmuon_compile.layouts.head_layouts` recognises (transformers', torchtitan's,
    multi-head latent attention): collects each head's max logit in the forward (training
    mode; SDPA and FlexAttention kernels), and :meth:`apply` scales the q/k weights of the
    heads above ``tau`` (the module docstring's rules). ``group``: the process group whose
    ranks agree on the maxima (one ``all_reduce(MAX)`` per :meth:`apply`, issued by every rank
    of it), or a list of groups whose product is that set (one reduction over each: a mesh's
    dimensions); default: the groups of the model's dedicated runtime
    (``dmuon.dedicate_params``: its data-parallel mesh, HSDP's replicate mesh, the TP group —
    with pipeline parallelism, the stage's own), else the default group when one is
    initialised. Every rank of it must hold the same attention modules.

    Weights may be plain tensors, dedicated weights (``dmuon.dedicate_params``), FSDP2
    ``Shard(0)`` and tensor-parallel ``Shard(0)`` DTensors; other placements raise
    ``ValueError``. Raises ``ValueError`` when no attention module is recognised, or one
    normalises q and k (QK-norm).

    Example::

        opt = dmuon.Muon(model, lr=0.02)
        clip = dmuon.QKClip(model, tau=100.0).attach(opt)
        for x in batches:
            model(x).loss.backward()
            opt.step()  # then the clip
            opt.zero_grad()
        print(clip.max_logits())  # {module name: per-head max of the last step}
    """

    def __init__(self, model: nn.Module, tau: float, *, group=None) -> None:
        if isinstance(tau, bool) or not isinstance(tau, (int, float)) or not 0 < tau < math.inf:
            raise ValueError(f"QKClip: tau={tau!r}: give the largest logit allowed (> 0)")
        self.tau = float(tau)
        self.group = group if group is not None else model_groups(model)
        self.attentions = _attentions(model)
        if not self.attentions:
            raise ValueError(
                "QKClip: no attention module recognised in the model (q_proj/k_proj/v_proj/"
                "o_proj or wq/wk/wv/wo with a head_dim or a head count, or multi-head latent "
                "attention): QK-clip needs to know each head's q and k rows"
            )
        heads = sum(a.n_heads for a in self.attentions)
        self.steps = 0
        self.clipped = torch.zeros(heads, dtype=torch.int64)  # per head: steps it was clipped
        self.last_max = torch.full((heads,), float("nan"))  # per head: the last step's max
        self._warned: set[str] = set()
        self._handles: list = []
        self.flex_op = _flex_op()
        # a pipeline stage's metadata forward (empty inputs past the first stage) is no step's
        _compat.wrap_pipeline_metadata_forwards(not_collecting)
        for att in self.attentions:
            self._handles.append(att.module.register_forward_pre_hook(self._enter(att)))
            self._handles.append(
                att.module.register_forward_hook(self._leave(att), always_call=True)
            )
            for wrapper in _flex_wrappers(att.module):
                self._handles.append(
                    wrapper.register_forward_pre_hook(self._enter_flex(att), with_kwargs=True)
                )
                self._handles.append(
                    wrapper.register_forward_hook(
                        self._leave_flex(att), with_kwargs=True, always_call=True
                    )
                )

    # ------------------------------------------------------------------ wiring
    def attach(self, optimizer: torch.optim.Optimizer) -> QKClip:
        """Run :meth:`apply` after every ``optimizer.step()`` and keep this clip's state
        (``tau``, the clipped-head counters, the last maxima) in ``optimizer.state_dict()``
        under ``"qk_clip"``, loaded back by ``optimizer.load_state_dict``. Returns ``self``.
        (``torch.distributed.checkpoint``'s ``get_state_dict`` keeps only ``state`` and
        ``param_groups``: save :meth:`state_dict` beside it.)

        Example::

            clip = dmuon.QKClip(model, tau=100.0).attach(opt)
        """
        self._handles += [
            optimizer.register_step_post_hook(lambda opt, args, kwargs: self.apply()),
            optimizer.register_state_dict_post_hook(self._save_into),
            optimizer.register_load_state_dict_pre_hook(self._load_from),
        ]
        return self

    def remove(self) -> None:
        """Remove every hook this clip registered (modules and optimizer)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _save_into(self, optimizer, state_dict: dict) -> dict:
        state_dict[_STATE_KEY] = self.state_dict()
        return state_dict

    def _load_from(self, optimizer, state_dict: dict) -> dict:
        saved = state_dict.pop(_STATE_KEY, None)  # a shallow copy: the caller's dict keeps it
        if saved is not None:
            self.load_state_dict(saved)
        return state_dict

    def state_dict(self) -> dict:
        """``tau``, ``steps``, per head ``clipped`` (steps it was clipped) and ``last_max``,
        and ``heads`` (each attention module's head count, checked at load)."""
        return {
            "tau": self.tau,
            "steps": self.steps,
            "clipped": self.clipped.clone(),
            "last_max": self.last_max.clone(),
            "heads": {a.name: a.n_heads for a in self.attentions},
        }

    def load_state_dict(self, state: dict) -> None:
        """Load :meth:`state_dict`'s ``tau``, steps, counters and maxima (the model's
        attention heads must match: ``ValueError`` otherwise)."""
        heads = {a.name: a.n_heads for a in self.attentions}
        if dict(state["heads"]) != heads:
            raise ValueError(
                f"QKClip.load_state_dict: saved for attention heads {dict(state['heads'])}, "
                f"this model has {heads}: load it into the model it was saved from"
            )
        self.tau = float(state["tau"])
        self.steps = int(state["steps"])
        self.clipped = state["clipped"].detach().to("cpu", torch.int64).clone()
        self.last_max = state["last_max"].detach().to("cpu", torch.float32).clone()

    def max_logits(self) -> dict[str, Tensor]:
        """Per attention module, each head's max logit of the last :meth:`apply` (all ranks')."""
        out, start = {}, 0
        for att in self.attentions:
            out[att.name] = self.last_max[start : start + att.n_heads]
            start += att.n_heads
        return out

    # ------------------------------------------------------------------ collection
    def _enter(self, att: _Attention):
        def hook(module, args):
            if module.training and not getattr(_PAUSED, "depth", 0):
                mode = _Collect(self, att)
                mode.__enter__()
                att.modes.append(mode)
                if not torch.compiler.is_compiling():  # a Python count would guard: recompiles
                    att.forwards += 1
                    # made here, not first in a compiled kernel region (flex_attention's): a
                    # region traced before it existed would be traced again after
                    x = next((a for a in args if isinstance(a, Tensor)), None)
                    if att.running is None and x is not None and x.device.type != "meta":
                        att.running = torch.full((att.n_heads,), -math.inf, device=x.device)

        return hook

    def _leave(self, att: _Attention):
        def hook(module, args, output):
            if att.modes:
                att.modes.pop().__exit__(None, None, None)

        return hook

    def _enter_flex(self, att: _Attention):
        """Pre-hook of torchtitan's ``FlexAttention`` wrapper: its ``q``, ``k`` (``(B, L, N,
        H)``), ``BlockMask``, ``score_mod`` and ``scale``, before its compiled kernel. Taken
        here rather than from the op it calls: this runs in the model's own mode (eager
        or compiled), not traced into torchtitan's compiled kernel region."""
        from torch.nn.attention.flex_attention import BlockMask

        def hook(module, args, kwargs):
            if not att.modes:  # eval mode, or not inside the attention's forward
                return
            q = args[0] if len(args) > 0 else kwargs.get("q_BLNH")
            k = args[1] if len(args) > 1 else kwargs.get("k_BLNH")
            mask = kwargs.get("attention_masks")
            if not (isinstance(q, Tensor) and isinstance(k, Tensor) and q.dim() == 4):
                return  # the op's own call is seen instead
            q, k = _local(q).transpose(1, 2), _local(k).transpose(1, 2)
            lengths = (q.shape[-2], k.shape[-2])
            if not isinstance(mask, BlockMask) or tuple(mask.seq_lengths) != lengths:
                return  # e.g. context parallelism rewrote them: the op's call is seen instead
            att.modes[-1].wrapped += 1
            maxima = max_logits_flex(
                q, k, block_mask=mask, score_mod=kwargs.get("score_mod"), scale=kwargs.get("scale")
            )
            self._record(att, maxima)

        return hook

    def _leave_flex(self, att: _Attention):
        def hook(module, args, kwargs, output):
            if att.modes and att.modes[-1].wrapped:
                att.modes[-1].wrapped -= 1

        return hook

    def _record_flex_call(self, att: _Attention, args, kwargs) -> None:
        """A ``flex_attention`` op call seen by the mode: its q, k, block mask and score_mod."""
        args = tuple(_local(a) if isinstance(a, Tensor) else a for a in args)
        self._record(att, max_logits_of_flex_call(args, kwargs))

    def _record_sdpa(self, att: _Attention, args, kwargs) -> None:
        call = dict(zip(_SDPA_ARGS, args), **kwargs)
        q, k = _local(call["query"]), _local(call["key"])
        maxima = max_logits(
            q,
            k,
            scale=call.get("scale"),
            is_causal=bool(call.get("is_causal", False)),
            attn_mask=call.get("attn_mask"),
        )
        self._record(att, maxima)

    def observe(self, module: nn.Module | str, max_scores: Tensor) -> None:
        """Hand over max logits a kernel reported for ``module`` (the attention module or its
        name), for kernels QK-clip does not see (SDPA and FlexAttention calls are collected
        automatically): FlexAttention's ``aux.max_scores`` (``(B, H, L)``, from
        ``return_aux=AuxRequest(max_scores=True)``; CUDA only on torch 2.11 and 2.13), or any
        tensor with the heads on dim -2, or a ``(H,)`` per-head max. Kept as the automatic
        collection keeps its maxima (the max since the last :meth:`apply`).

        Example (inside the attention's forward)::

            out, aux = flex_attention(q, k, v, block_mask=mask,
                                      return_aux=AuxRequest(max_scores=True))
            clip.observe(self, aux.max_scores)
        """
        att = next((a for a in self.attentions if a.module is module or a.name == module), None)
        if att is None:
            raise ValueError(f"QKClip.observe: {module!r} is not one of this clip's attentions")
        with torch.no_grad():
            m = max_scores.detach()
            per_head = m if m.dim() == 1 else m.movedim(-2, 0).reshape(m.shape[-2], -1).amax(1)
            self._record(att, per_head.float())

    def _record(self, att: _Attention, maxima: Tensor) -> None:
        first = 0 if maxima.numel() == att.n_heads else self._first_head(att, maxima.numel())
        if att.running is None:
            att.running = torch.full((att.n_heads,), -math.inf, device=maxima.device)
        seen = att.running[first : first + maxima.numel()]
        torch.maximum(seen, maxima.to(seen.device), out=seen)
        if not torch.compiler.is_compiling():
            att.records += 1

    @staticmethod
    def _first_head(att: _Attention, n: int) -> int:
        """The first head of a tensor-parallel shard that holds ``n`` of the heads: from the
        rows its q weight holds (whole heads, ``Shard(0)``)."""
        with torch.no_grad():
            _, start, stop = _local_rows(att.q_owner.weight, f"{att.name}'s q weight")
        rows, heads = att.unit
        if start % rows or (stop - start) * heads != n * rows:
            raise ValueError(
                f"QKClip: the attention {att.name!r} computed {n} of its {att.n_heads} heads, "
                f"but its q weight's local rows {start}:{stop} are not whole pieces of {rows} "
                f"rows holding {heads} q head(s) each: shard q/k column-parallel by whole heads "
                "(Shard(0))"
            )
        return start // rows * heads

    # ------------------------------------------------------------------ the clip itself
    def apply(self) -> int:
        """Reduce the heads' maxima over the group (one ``all_reduce(MAX)``), scale the q/k
        rows of every head above ``tau`` and start collecting anew. Returns how many heads
        were clipped (the same on every rank). Collective: every rank of the group calls it
        (:meth:`attach` does, after each step)."""
        maxima = self._reduce()
        self.steps += 1
        self.last_max = maxima
        fire = torch.isfinite(maxima) & (maxima > self.tau)
        self.clipped += fire
        gamma = torch.ones(maxima.shape, dtype=torch.float64)
        gamma[fire] = self.tau / maxima[fire].double()
        self._warn_unseen()
        if fire.any():
            self._scale(gamma)
        for att in self.attentions:
            if att.running is not None:  # kept (a compiled forward guards on it), emptied
                att.running.fill_(-math.inf)
            att.forwards, att.records = 0, 0
        return int(fire.sum())

    def _reduce(self) -> Tensor:
        import torch.distributed as dist

        device = next((a.running.device for a in self.attentions if a.running is not None), None)
        if device is None:
            device = self._device()
        packed = torch.cat(
            [
                a.running.to(device)
                if a.running is not None
                else torch.full((a.n_heads,), -math.inf, device=device)
                for a in self.attentions
            ]
        )
        if dist.is_available() and dist.is_initialized():
            groups = self.group if self.group is not None else dist.group.WORLD
            for group in groups if isinstance(groups, (list, tuple)) else [groups]:
                if dist.get_world_size(group) > 1:  # MAX over each: over their product
                    dist.all_reduce(packed, op=dist.ReduceOp.MAX, group=group)
        return packed.float().cpu()

    def _device(self) -> torch.device:
        """Where a rank that saw no forward packs its maxima: the backend's device (NCCL:
        CUDA), else the first q weight's."""
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            groups = self.group if isinstance(self.group, (list, tuple)) else [self.group]
            if dist.get_backend(groups[0] if groups else None) == "nccl":
                return torch.device("cuda", torch.cuda.current_device())
        device = self.attentions[0].q_owner.weight.device
        return device if device.type != "meta" else torch.device("cpu")

    def _warn_unseen(self) -> None:
        for att in self.attentions:
            if not att.forwards or att.records or att.traced or att.name in self._warned:
                continue
            # records made in a compiled region (flex_attention compiles its op) are not
            # counted: finite maxima show them (one check per attention, then remembered)
            if att.running is not None and bool(torch.isfinite(att.running).any()):
                att.traced = True
                continue
            self._warned.add(att.name)
            warnings.warn(
                f"QKClip: the attention {att.name!r} ran forward without a "
                "scaled_dot_product_attention or flex_attention call (eager attention or "
                "another kernel): its heads are not clipped. Use SDPA or FlexAttention there, "
                "or hand its max logits over with clip.observe(module, max_scores)",
                stacklevel=3,
            )

    def _scale(self, gamma: Tensor) -> None:
        writes, start = [], 0
        for att in self.attentions:
            g = gamma[start : start + att.n_heads]
            start += att.n_heads
            if bool((g < 1).any()):
                for rows in att.rows:
                    factor = g[rows.head] ** rows.power
                    if bool((factor < 1).any()):
                        writes += [(rows, factor, n) for n in ("weight", "bias")]
        with torch.no_grad():
            self._note_owner_writes([getattr(r.owner, n, None) for r, _, n in writes])
            for rows, factor, name in writes:
                t = getattr(rows.owner, name, None)
                if not isinstance(t, Tensor):
                    continue
                local, first, stop = _local_rows(t, f"{rows.fqn[: -len('weight')]}{name}")
                if local.numel() == 0:
                    continue
                work = torch.promote_types(local.dtype, torch.float32)  # fp32 multiply
                f = factor[first:stop].to(local.device, work)
                local.mul_(f.view(-1, *([1] * (local.dim() - 1))))

    @staticmethod
    def _note_owner_writes(tensors) -> None:
        """Dedicated weights are about to be written between steps: pending updates land
        first and the next forward publishes (HSDP replicas, TP members)."""
        owned = sys.modules.get("dmuon_compile.distributed._owner.tensor")
        if owned is not None and any(isinstance(t, owned.OwnerTensor) for t in tensors):
            from dmuon_compile.distributed._comm import pending as _pending

            _pending.before_access(write=True)
