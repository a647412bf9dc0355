"""NorMuon: Muon's orthogonalised update normalised neuron by neuron (``Muon(normuon=True)``).

For each matrix's Newton–Schulz result ``O`` (``m × n`` in the layout's ``(out, in)``
orientation: a row is an output neuron), the published NorMuon step (Li et al., 2025,
arXiv:2510.05491, and its reference code) keeps one second moment per row:

    v ← β₂·v + (1 − β₂)·mean_j(O_ij²)        (``lerp``, no bias correction)
    Ô = O / (√v + ε)                          (ε outside the square root)
    Ô ← Ô · ‖O‖_F / (‖Ô‖_F + ε)               (the update's Frobenius norm is Muon's)

then the usual learning-rate scale and update. Bias correction would scale every row of a
matrix by one factor, which the Frobenius rescale takes out again: the reference has none, and
neither has this. ε (default 1e-10, the reference's) matters only for rows whose ``v`` is about
zero (an orthogonalised row has ``mean_j O_ij² ≈ 1/max(m, n)``).

``v`` is the state ``state["normuon_second_moment"]``, fp32, of the parameter's shape with its
matrices' input dim cut down to the number of matrices along it (:func:`moment_shape`): ``(m,
1)`` for a 2-D ``(m, n)`` weight, ``(E, m, 1)`` for an expert stack, ``(1, n)`` for a
transposed ``(in, out)`` weight, ``(d, H)`` for an output projection ``(d, H·h)`` per head
along its columns. It keeps the parameter's leading (expert) dim and output dim, so a DTensor
state on the parameter's mesh and placements (an owner's one-rank mesh; an expert stack sharded
along the expert dim) holds each rank's rows, and ``torch.distributed.checkpoint`` saves and
reshards it like the momentum (``normuon_state.py`` creates it).

The math runs in the step's first half (``functional.muon_directions``: ``v′`` out of place,
the normalised direction returned); the commit stores ``v′`` with the momentum
(``functional.commit_muon_step``), so a step that does not commit leaves ``v`` unchanged.

Expert stacks sharded inside their experts (FSDP2's ``Shard(1)``/``Shard(2)``) or split over
HSDP's replicas (``Muon(expert_ns="once")``) go through the expert reshard stage
(``distributed/_stages/expert_shards.py``): ``v`` travels with ``u`` to the members that hold whole
experts, :func:`normalize` runs there right after Newton–Schulz, and each member gets its rows of
``v′`` back with its pieces of the direction; its commit stores them like any other.

Tensor-parallel dedicated weights go through the TP stage (``distributed/_stages/tp/stage.py``):
``v`` lives on the weight's owner TP group, each member its rows (or all of them where TP cuts the
input dim: ``_stages/tp/moments.py``); the TP owner normalises the whole matrix right after
Newton–Schulz (before a per-head matrix's per-block learning-rate scale, as here), with the
members' rows of ``v`` gathered there, and sends each member its rows of ``v′``; where every
member holds whole blocks (per head) it normalises its own. ``v′`` is stored with the momentum
by the TP stage's commit. Split Newton–Schulz (``dedicate_params(split_size=k)``) gathers the
whole result back to the owner, which holds the whole ``v`` and normalises there
(``distributed/_stages/split_step.py``). A stage that would skip the normalisation is refused
(:func:`refuse_unsupported`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from dmuon_compile.layouts import Layout

SECOND_MOMENT = "normuon_second_moment"  # the state key


class NorMuon(NamedTuple):
    """NorMuon's hyper-parameters (``Muon(normuon=True)`` takes the defaults).

    - ``beta2``: the second moment's decay β₂ in ``[0, 1)`` (default 0.95, the reference's);
    - ``eps``: ε > 0 of ``O / (√v + ε)`` and of the Frobenius rescale (default 1e-10).

    A NamedTuple of floats: the compiled step takes it as a constant.

    >>> NorMuon(beta2=0.9).checked()
    NorMuon(beta2=0.9, eps=1e-10)
    """

    beta2: float = 0.95
    eps: float = 1e-10

    def checked(self) -> NorMuon:
        beta2, eps = self
        if isinstance(beta2, bool) or not isinstance(beta2, (int, float)) or not 0 <= beta2 < 1:
            raise ValueError(
                f"NorMuon(beta2={beta2!r}): the second moment's decay must be a float in [0, 1), "
                "e.g. dmuon.NorMuon(beta2=0.95)"
            )
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 < eps < math.inf:
            raise ValueError(
                f"NorMuon(eps={eps!r}): eps must be a positive finite float, e.g. "
                "dmuon.NorMuon(eps=1e-10)"
            )
        return NorMuon(float(beta2), float(eps))


def resolve(value) -> NorMuon | None:
    """``Muon(normuon=...)`` as the step uses it: ``None`` (off) or a checked :class:`NorMuon`.

    >>> resolve(False), resolve(True)
    (None, NorMuon(beta2=0.95, eps=1e-10))
    """
    if value is None or value is False:
        return None
    if value is True:
        return NorMuon()
    if isinstance(value, NorMuon):
        return value.checked()
    raise ValueError(
        f"normuon={value!r}: pass True (β₂=0.95, ε=1e-10), False, or "
        "dmuon.NorMuon(beta2=..., eps=...) for other values"
    )


# ---------------------------------------------------------------------- where the rows are
def _geometry(layout: Layout, shape) -> tuple[int, int, int, str | None]:
    """``(k0, c, out, along)``: stacked matrices (experts) ``k0``; matrices per stacked one
    ``c``; the stored output dim's size ``out``; and which dim the layout cuts into matrices:
    ``"out"``, ``"in"`` or ``None``."""
    k0 = int(shape[0]) if layout.kind == "experts" else 1
    c = layout.count(shape) // k0
    if layout.kind == "conv":
        return k0, c, int(shape[0]), None
    out = int(shape[-1] if layout.transposed else shape[-2])
    along = None
    if layout.split is not None or layout.blocked:
        along = "out" if layout.split_dim == (1 if layout.transposed else 0) else "in"
    return k0, c, out, along


def moment_shape(layout: Layout, shape) -> tuple[int, ...]:
    """The second moment's shape for a parameter of ``shape``: ``shape`` with the matrices'
    input dim cut to the number of matrices along it (1 unless the layout's halves or blocks
    lie along the input dim); a conv kernel ``(out, *rest)``: ``(out, 1, …)``.

    >>> moment_shape(Layout(), (8, 4)), moment_shape(Layout.experts(), (3, 8, 4))
    ((8, 1), (3, 8, 1))
    >>> moment_shape(Layout.heads(2, dim=1), (8, 6)), moment_shape(Layout(transposed=True), (8, 4))
    ((8, 3), (1, 4))
    """
    shape = tuple(int(s) for s in shape)
    if layout.kind == "conv":
        return (shape[0],) + (1,) * (len(shape) - 1)
    _, c, _, along = _geometry(layout, shape)
    in_dim = len(shape) - (2 if layout.transposed else 1)
    return shape[:in_dim] + ((c if along == "in" else 1),) + shape[in_dim + 1 :]


def _rows(v: Tensor, layout: Layout, shape) -> Tensor:
    """The stored second moment ``v`` as ``(k, r)``: matrix by matrix (the order of
    ``layout.matrices``), each matrix's output neurons."""
    k0, c, out, along = _geometry(layout, shape)
    c_in = c if along == "in" else 1
    y = v.reshape(k0, c_in, out).transpose(1, 2) if layout.transposed else v.reshape(k0, out, c_in)
    if along == "in":
        return y.transpose(1, 2).reshape(k0 * c, out)
    z = y.reshape(k0, out)
    if along == "out" and layout.split == "interleave":  # stored row 2i + h: half h's row i
        z = z.reshape(k0, out // 2, 2).transpose(1, 2)
    return z.reshape(k0 * c, out // c)


def _stored(rows: Tensor, layout: Layout, shape) -> Tensor:
    """The inverse of :func:`_rows`: ``(k, r)`` back in :func:`moment_shape`."""
    k0, c, out, along = _geometry(layout, shape)
    if along == "in":
        y = rows.reshape(k0, c, out).transpose(1, 2)
    else:
        z = rows.reshape(k0, c, out // c)
        if along == "out" and layout.split == "interleave":
            z = z.transpose(1, 2)
        y = z.reshape(k0, out, 1)
    if layout.transposed:
        y = y.transpose(1, 2)
    return y.reshape(moment_shape(layout, shape))


# ---------------------------------------------------------------------- the step's math
def normalize(o: Tensor, v: Tensor, layout: Layout, config: NorMuon) -> tuple[Tensor, Tensor]:
    """NorMuon of one parameter's Newton–Schulz result ``o`` (the parameter's shape) with its
    second moment ``v`` (:func:`moment_shape`, fp32): ``(Ô, v′)``, both new (``v`` is not
    written), ``Ô`` in ``o``'s dtype, computed in fp32.

    A blocked layout whose blocks differ in shape goes piece by piece (``Layout.pieces``).
    ``‖Ô‖_F`` comes from the rows' sums of squares (``Σ_i s_i / (√v′_i + ε)²``), so ``Ô`` is
    formed once, by one broadcast product.
    """
    pieces = layout.pieces(o.shape)
    if len(pieces) > 1:
        dim = layout.block_dim(o.shape)
        outs, moments, taken = [], [], 0
        along = _geometry(layout, o.shape)[3]
        for start, stop, sub in pieces:
            piece = o.narrow(dim, start, stop - start)
            if along == "out":  # the stored rows of the piece
                vp = v.narrow(dim, start, stop - start)
            else:  # the piece's blocks along the input dim
                count = _geometry(sub, piece.shape)[1]
                vp = v.narrow(dim, taken, count)
                taken += count
            a, b = normalize(piece, vp, sub, config)
            outs.append(a)
            moments.append(b)
        return torch.cat(outs, dim), torch.cat(moments, dim)
    mats = layout.matrices(o)
    mats = mats.reshape(-1, mats.shape[-2], mats.shape[-1])  # (k, m, n), stored orientation
    in_axis = 1 if layout.transposed else 2
    sums = torch.linalg.vector_norm(mats, dim=in_axis, dtype=torch.float32).square()  # (k, r)
    new = torch.lerp(
        _rows(v, layout, o.shape).float(), sums / mats.shape[in_axis], 1 - config.beta2
    )
    inv = 1.0 / (new.sqrt() + config.eps)
    norm_o = sums.sum(1, keepdim=True).sqrt()
    norm_hat = (sums * inv.square()).sum(1, keepdim=True).sqrt()
    factor = (inv * (norm_o / (norm_hat + config.eps))).unsqueeze(in_axis)
    out = (mats * factor).to(o.dtype)
    return layout.unmatrices(out, o.shape), _stored(new, layout, o.shape)


def normalize_all(
    ortho: Sequence[Tensor],
    moments: Sequence[Tensor],
    layouts: Sequence[Layout],
    config: NorMuon | None = None,
) -> tuple[list[Tensor], list[Tensor]]:
    """:func:`normalize` of every matrix: ``(directions, new second moments)``."""
    config = config or NorMuon()
    pairs = [normalize(o, v, lay, config) for o, v, lay in zip(ortho, moments, layouts)]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def moments_finite(moments: Sequence[Tensor]) -> Tensor:
    """Per second moment, whether it is finite (1-D bool): ``v′`` is finite iff the old ``v``
    and the direction were, so the compiled step's finite flags cover a loaded ``v`` too."""
    if not moments:
        return torch.zeros(0, dtype=torch.bool)
    return torch.isfinite(torch.stack(torch._foreach_norm(list(moments))))


def refuse_unsupported(plan, muon_params: Sequence[tuple[Tensor, Layout]]) -> None:
    """Raise ``NotImplementedError`` when ``Muon(normuon=...)`` meets a path that would step
    the matrices without the normalisation: a stage whose class does not say ``normuon_ok``
    (the expert reshard, ``_stages/expert_shards.py``; tensor parallelism, ``_stages/tp/stage.py``;
    split Newton–Schulz, ``_stages/split_step.py`` all do), or expert stacks sharded inside their
    experts without the reshard in the plan. Decided from the plan and the placements, the same on
    every rank, before any collective."""
    stages = [stage for stage in plan.stages if not getattr(stage, "normuon_ok", False)]
    what = next((stage.what for stage in stages), None)  # every stage: ``StepStage.what``
    if what is None and not any(getattr(s, "whole_experts", False) for s in plan.stages):
        from dmuon_compile.layouts import needs_reshard

        if any(needs_reshard(p, lay) for p, lay in muon_params):
            what = "expert stacks sharded inside their experts (Shard(1)/Shard(2))"
    if what is not None:
        raise NotImplementedError(
            f"normuon=True is not supported with {what} yet: that step would orthogonalise the "
            "matrices without the per-row normalisation. Build dmuon.Muon without normuon for "
            "this model"
        )
