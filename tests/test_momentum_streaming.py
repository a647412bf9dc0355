"""A stored momentum streamed bucket by bucket (``Muon(momentum_in_flight=...)``;
``momentum_storage.BucketStream``, ``Muon._streamed_directions``).

- Streamed steps equal the all-at-once step (``momentum_in_flight=None``, every working buffer
  before the first Newton–Schulz, written back after the commit) bit for bit: weights and every
  stored entry (8-bit codes, scales and rounds; host copies), over several steps, for 8-bit,
  offload, both, bf16 + offload and NorMuon, with matrices and expert stacks in several shape
  buckets, some cut by ``NewtonSchulz(stack_bytes=...)`` (hypothesis). An offloaded fp32
  momentum streamed equals the in-place momentum.
- Memory: the working momentum alive at once (``MomentumStorage.peak_working_bytes``, counted
  while each tensor lives) is at most ``in_flight`` of the largest buckets, and at least
  ``in_flight`` of the smallest (the next bucket is materialised ahead); control: ``None``, or a
  budget as large as the step, holds every matrix's. On the CPU allocator the 8-bit step's peak
  drops by the working buffers it no longer holds.
- A step that does not commit (a non-finite gradient in the last bucket, after earlier buckets
  were staged; skipped or raised; or Newton–Schulz failing in a later bucket) leaves the stored
  state exactly as it was, and the next step equals a run without it.
- A streamed run's ``state_dict`` resumes exactly; bad ``momentum_in_flight`` values raise
  naming the fix.
"""

from __future__ import annotations

import io

import pytest
import torch
from bench_scripts import load_benchmark  # tests/ is on sys.path
from hypothesis import given, settings
from hypothesis import strategies as st

import dmuon_compile as dmuon
from dmuon_compile import functional as F
from dmuon_compile import momentum_storage as S
from dmuon_compile.newton_schulz import NewtonSchulz

step_memory = load_benchmark("step_memory")
MU = 0.9
STORED = {
    "int8": {"momentum_dtype": torch.int8},
    "offload": {"offload": "momentum"},
    "int8_offload": {"momentum_dtype": "int8", "offload": "momentum"},
    "bf16_offload": {"momentum_dtype": "bf16", "offload": "momentum"},
}
# Several shape buckets: two (8, 12) matrices and an expert stack of (8, 12) matrices share one.
SHAPES = [(8, 12), (12, 6), (8, 12), (3, 8, 12), (16, 8), (5, 5), (12, 6)]


def _data(shapes, steps: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    weights = [torch.randn(s, generator=gen) for s in shapes]
    grads = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(steps)]
    return weights, grads


def _muon(weights, stack_bytes=None, **kwargs):
    params = [torch.nn.Parameter(w.clone()) for w in weights]
    for p in params:
        if p.dim() == 3:
            dmuon.set_layout(p, dmuon.Layout.experts())
    ns = NewtonSchulz(backend="direct", work_dtype=torch.float32)
    if stack_bytes is not None:
        ns = NewtonSchulz(backend="direct", work_dtype=torch.float32, stack_bytes=stack_bytes)
    kwargs.setdefault("compile", False)
    kwargs.setdefault("momentum", MU)
    opt = dmuon.Muon(params, lr=0.02, ns_backend=ns, **kwargs)
    return params, opt


def _steps(params, opt, grads):
    for step in grads:
        for p, g in zip(params, step):
            p.grad = g.clone()
        opt.step()


def _run(weights, grads, **kwargs):
    params, opt = _muon(weights, **kwargs)
    _steps(params, opt, grads)
    return params, opt


def _state(opt, params):
    return [
        {k: v.clone() if torch.is_tensor(v) else v for k, v in opt.state[p].items()} for p in params
    ]


def _assert_same(params_a, opt_a, params_b, opt_b):
    for a, b in zip(params_a, params_b):
        assert torch.equal(a.detach(), b.detach())
    for sa, sb in zip(_state(opt_a, params_a), _state(opt_b, params_b)):
        assert set(sa) == set(sb)
        for key in sa:
            if torch.is_tensor(sa[key]):
                assert sa[key].dtype == sb[key].dtype and torch.equal(sa[key], sb[key]), key
            else:
                assert sa[key] == sb[key], key


def _buckets(opt, params):
    grads = [p.grad for p in params]
    return F.shape_buckets(grads, [opt._layout(p) for p in params], opt.ns.stack_bytes)


@settings(max_examples=12, deadline=None)
@given(
    picks=st.lists(st.integers(0, len(SHAPES) - 1), min_size=1, max_size=8),
    setting=st.sampled_from(sorted(STORED)),
    in_flight=st.integers(1, 4),
    stack_matrices=st.sampled_from([None, 1, 2]),
    normuon=st.booleans(),
    nesterov=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_streamed_steps_equal_the_all_at_once_step_bit_for_bit(
    picks, setting, in_flight, stack_matrices, normuon, nesterov, seed
):
    shapes = [SHAPES[i] for i in picks]
    weights, grads = _data(shapes, 3, seed)
    # stack_bytes of one or two (8, 12) matrices: the shared bucket is cut into stacks
    stack = None if stack_matrices is None else stack_matrices * 8 * 12 * 4
    kw = dict(STORED[setting], stack_bytes=stack, normuon=normuon, nesterov=nesterov)
    ref, ref_opt = _run(weights, grads, momentum_in_flight=None, **kw)
    got, got_opt = _run(weights, grads, momentum_in_flight=in_flight, **kw)
    _assert_same(ref, ref_opt, got, got_opt)


def test_the_shapes_make_several_buckets_and_a_cut_one():
    """What the property above runs on: several buckets; a stack budget cuts the shared one."""
    params, opt = _muon([torch.zeros(s) for s in SHAPES])
    for p in params:
        p.grad = torch.zeros_like(p)
    assert len(_buckets(opt, params)) == 4
    _, cut = _muon([torch.zeros(s) for s in SHAPES], stack_bytes=8 * 12 * 4)
    assert len(_buckets(cut, params)) == 7


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_a_streamed_offloaded_momentum_equals_the_one_in_place(dtype):
    weights, grads = _data(SHAPES, 4, seed=1)
    on, on_opt = _run(weights, grads, momentum_dtype=dtype)
    off, off_opt = _run(weights, grads, momentum_dtype=dtype, offload="momentum")
    assert off_opt.momentum_in_flight == S.IN_FLIGHT
    for a, b in zip(on, off):
        assert torch.equal(a.detach(), b.detach())
    for p, q in zip(on, off):
        assert torch.equal(on_opt.state[p]["momentum_buffer"], off_opt.state[q][S.HOST])
    # control: the comparison sees the momentum (another μ ends elsewhere)
    other, _ = _run(weights, grads, offload="momentum", momentum=0.5)
    assert not torch.equal(other[0].detach(), on[0].detach())


# ---------------------------------------------------------------- memory
# Eight shape buckets of about the same size, two matrices each (test_step_memory's).
MANY = [(32, 32), (16, 64), (64, 16), (24, 40), (40, 24), (8, 128), (128, 8), (20, 48)] * 2


def _working_peak(setting: str, in_flight, shapes=MANY) -> tuple[int, list[int]]:
    """The peak working momentum bytes of a step after the first (state exists), and each
    bucket's working bytes."""
    weights, grads = _data(shapes, 2)
    params, opt = _run(weights, grads, momentum_in_flight=in_flight, **STORED[setting])
    sizes = [sum(4 * params[i].numel() for i in idx) for idx in _buckets(opt, params)]
    assert opt._storage.working_bytes == 0  # nothing left alive between steps
    return opt._storage.peak_working_bytes, sizes


@pytest.mark.parametrize("setting", ["int8", "offload"])
@pytest.mark.parametrize("in_flight", [1, 2, 3])
def test_the_working_momentum_at_once_is_the_buckets_in_flight(setting, in_flight):
    peak, sizes = _working_peak(setting, in_flight)
    assert len(sizes) == 8 and max(sizes) * 3 < sum(sizes)
    assert peak <= in_flight * max(sizes)
    assert peak >= sum(sorted(sizes)[:in_flight])  # the next buckets really are ahead


@pytest.mark.parametrize("setting", ["int8", "offload"])
@pytest.mark.parametrize("in_flight", [None, 8, 100], ids=["all_at_once", "as_many", "more"])
def test_control_a_budget_of_everything_holds_every_matrix(setting, in_flight):
    peak, sizes = _working_peak(setting, in_flight)
    assert peak == sum(sizes)


def test_an_offloaded_stream_cuts_its_buckets_to_the_offload_cap(monkeypatch):
    """Offloaded, the streamed buckets are cut to ``OFFLOAD_BUCKET_BYTES`` (the first bucket's
    copy-in is what the step waits for): with the cap at one matrix the peak is in_flight
    matrices, not in_flight buckets, and the result equals the all-at-once step bit for bit.
    Control: the 8-bit momentum on the GPU keeps NS's buckets."""
    one = max(4 * torch.Size(s).numel() for s in MANY)
    monkeypatch.setattr(S, "OFFLOAD_BUCKET_BYTES", one)
    assert S.stream_bucket_bytes(None, "momentum") == one
    assert S.stream_bucket_bytes(10 * one, "momentum") == one
    assert S.stream_bucket_bytes(one // 2, "momentum") == one // 2  # NS's own cap is smaller
    assert S.stream_bucket_bytes(10 * one, None) == 10 * one
    peak, sizes = _working_peak("offload", 2)
    assert min(sizes) > one  # NS's buckets hold two matrices each
    assert peak <= 2 * one < sum(sorted(sizes)[-2:])
    control, _ = _working_peak("int8", 2)
    assert control > 2 * one
    weights, grads = _data(MANY, 3, seed=2)
    ref, ref_opt = _run(weights, grads, momentum_in_flight=None, offload="momentum")
    got, got_opt = _run(weights, grads, momentum_in_flight=2, offload="momentum")
    _assert_same(ref, ref_opt, got, got_opt)


def _allocator_peak(in_flight) -> tuple[int, int, int]:
    weights, grads = _data(MANY, 1)
    params, opt = _run(weights, grads, momentum_in_flight=in_flight, momentum_dtype=torch.int8)
    peak = step_memory.peak_extra_bytes(opt.step, torch.device("cpu"))
    return peak, sum(4 * p.numel() for p in params), step_memory.largest_bucket_fp32_bytes(MANY)


def test_on_the_cpu_allocator_the_8bit_step_peak_drops_by_the_working_buffers():
    """The step's real peak (CPU allocator events): streamed, it holds at most two buckets'
    working buffers where the all-at-once step (the control) holds all eight."""
    control, total, bucket = _allocator_peak(None)
    assert control > total  # the measurement sees the working buffers at all
    for in_flight in (1, 2):
        streamed, _, _ = _allocator_peak(in_flight)
        assert control - streamed >= total - 2 * bucket, (in_flight, control, streamed)


# ---------------------------------------------------------------- a step that does not commit
@pytest.mark.parametrize("setting", sorted(STORED))
@pytest.mark.parametrize("mode", ["skip", "raise"])
def test_a_nonfinite_step_leaves_the_stored_momentum_as_it_was(setting, mode):
    """The NaN is in the last bucket: every earlier bucket's shadow was made, none is kept."""
    weights, grads = _data(SHAPES, 4, seed=2)
    kw = dict(STORED[setting], nonfinite_grads=mode)
    params, opt = _run(weights, grads[:2], **kw)
    before, start = _state(opt, params), [p.detach().clone() for p in params]
    last = _buckets(opt, params)[-1][-1]
    for p, g in zip(params, grads[2]):
        p.grad = g.clone()
    params[last].grad[0, 0] = float("nan")
    if mode == "skip":
        with pytest.warns(UserWarning, match="skipped"):
            opt.step()
    else:
        with pytest.raises(FloatingPointError):
            opt.step()
    assert opt._storage._staged == [] and opt._storage.working_bytes == 0
    ref, ref_opt = _run(weights, grads[:2], **kw)
    _assert_same(ref, ref_opt, params, opt)
    for a, b in zip(start, params):
        assert torch.equal(a, b.detach())
    assert [set(s) for s in before] == [set(s) for s in _state(opt, params)]
    # the next step equals a run that never saw the bad one
    _steps(params, opt, grads[3:])
    _steps(ref, ref_opt, grads[3:])
    _assert_same(ref, ref_opt, params, opt)


class _FailsLater(NewtonSchulz):
    """Newton–Schulz that raises on its ``fail_at``-th call (a later bucket's)."""

    fail_at = 0
    calls = 0

    def __call__(self, *args, **kwargs):
        type(self).calls += 1
        if type(self).calls == type(self).fail_at:
            raise RuntimeError("NS failed in a later bucket")
        return super().__call__(*args, **kwargs)


@pytest.mark.parametrize("setting", ["int8", "offload"])
def test_a_failure_in_a_later_bucket_writes_nothing(setting):
    weights, grads = _data(SHAPES, 3, seed=4)
    params, opt = _run(weights, grads[:1], **STORED[setting])
    ref, ref_opt = _run(weights, grads[:1], **STORED[setting])
    opt.ns = _FailsLater(backend="direct", work_dtype=torch.float32)
    _FailsLater.calls, _FailsLater.fail_at = 0, 3
    for p, g in zip(params, grads[1]):
        p.grad = g.clone()
    with pytest.raises(RuntimeError, match="later bucket"):
        opt.step()
    assert _FailsLater.calls == 3  # two buckets staged before
    _assert_same(ref, ref_opt, params, opt)
    _FailsLater.fail_at = 0
    _steps(params, opt, grads[2:])
    _steps(ref, ref_opt, grads[2:])
    _assert_same(ref, ref_opt, params, opt)


# ---------------------------------------------------------------- checkpoints and options
def test_a_streamed_run_resumes_from_its_state_dict_exactly():
    weights, grads = _data(SHAPES, 4, seed=5)
    params, opt = _run(weights, grads[:2], offload="momentum")
    stream = io.BytesIO()
    torch.save(opt.state_dict(), stream)
    stream.seek(0)
    resumed, resumed_opt = _muon([p.detach() for p in params], offload="momentum")
    resumed_opt.load_state_dict(torch.load(stream, weights_only=True))
    _steps(params, opt, grads[2:])
    _steps(resumed, resumed_opt, grads[2:])
    _assert_same(params, opt, resumed, resumed_opt)


def test_momentum_in_flight_can_change_between_steps():
    weights, grads = _data(SHAPES, 4, seed=6)
    ref, ref_opt = _run(weights, grads, momentum_dtype="int8", momentum_in_flight=None)
    params, opt = _run(weights, grads[:2], momentum_dtype="int8")
    opt.momentum_in_flight = None
    _steps(params, opt, grads[2:3])
    opt.momentum_in_flight = 1
    assert opt.momentum_in_flight == 1 and opt.momentum_dtype == torch.int8
    _steps(params, opt, grads[3:])
    _assert_same(ref, ref_opt, params, opt)


@pytest.mark.parametrize("bad", [0, -1, True, 1.5, "2"])
def test_a_bad_momentum_in_flight_names_the_fix(bad):
    with pytest.raises(ValueError, match=r"momentum_in_flight=.*positive number.*or None"):
        dmuon.Muon(
            [torch.nn.Parameter(torch.randn(4, 4))], offload="momentum", momentum_in_flight=bad
        )
    opt = dmuon.Muon([torch.nn.Parameter(torch.randn(4, 4))])
    with pytest.raises(ValueError, match="momentum_in_flight"):
        opt.momentum_in_flight = bad


# ---------------------------------------------------------------- on a GPU (skipped without one)
# Eight buckets of two matrices (2-2.3 MiB each in fp32).
GPU_SHAPES = [
    (512, 1024),
    (1024, 512),
    (768, 768),
    (256, 2048),
    (2048, 256),
    (640, 896),
    (384, 1536),
    (1536, 384),
] * 2


def _gpu_run(in_flight, steps=3, compile=False, **kwargs):
    gen = torch.Generator().manual_seed(8)
    weights = [torch.randn(s, generator=gen).cuda() for s in GPU_SHAPES]
    grads = [[torch.randn(s, generator=gen).cuda() for s in GPU_SHAPES] for _ in range(steps)]
    params = [torch.nn.Parameter(w.clone()) for w in weights]
    opt = dmuon.Muon(params, lr=0.02, momentum=MU, compile=compile, **kwargs)
    opt.momentum_in_flight = in_flight
    for step in grads[:-1]:
        for p, g in zip(params, step):
            p.grad = g.clone()
        opt.step()
    for p, g in zip(params, grads[-1]):
        p.grad = g.clone()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    opt.step()  # the measured step
    torch.cuda.synchronize()
    return params, opt, torch.cuda.max_memory_allocated() - before


@pytest.mark.gpu
@pytest.mark.parametrize("compile", [False, True])
@pytest.mark.parametrize("setting", ["int8", "offload", "int8_offload"])
def test_on_the_gpu_streamed_steps_equal_the_all_at_once_step(setting, compile):
    """CUDA: each bucket's copy in (or decode) on the side stream, its copy out on the other,
    the host waiting for the released buckets: a race shows as a mismatch. Eager and compiled
    (per-bucket graphs against the one graph: the same operations, expected to give the same
    bits)."""
    ref, ref_opt, _ = _gpu_run(None, compile=compile, **STORED[setting])
    got, got_opt, _ = _gpu_run(2, compile=compile, **STORED[setting])
    _assert_same(ref, ref_opt, got, got_opt)


@pytest.mark.gpu
@pytest.mark.parametrize("setting", ["int8", "offload"])
def test_on_the_gpu_the_streamed_step_peak_drops_by_the_working_buffers(setting):
    """``max_memory_allocated`` of one step: streamed, the GPU holds the buckets in flight
    (the host waits for a released bucket before the next); control: all at once."""
    _, _, control = _gpu_run(None, **STORED[setting])
    _, opt, streamed = _gpu_run(2, **STORED[setting])
    bucket = max(2 * 4 * torch.Size(s).numel() for s in GPU_SHAPES)
    total = sum(4 * torch.Size(s).numel() for s in GPU_SHAPES)
    assert opt._storage.peak_working_bytes <= 2 * bucket
    assert control - streamed >= total - 3 * bucket, (control, streamed, total, bucket)
