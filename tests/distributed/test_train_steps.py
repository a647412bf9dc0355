"""The shared training loop, ``harness.train_steps``, in one process (no ranks spawned): the
slice each rank trains on, the order of the hooks around ``step()`` and the losses it returns."""

from __future__ import annotations

import torch

from .harness import train_steps


class _Recorder(torch.optim.SGD):
    """SGD that logs its ``step`` and ``zero_grad`` calls into a shared list."""

    def __init__(self, params, log):
        super().__init__(params, lr=0.1)
        self.log = log

    def step(self, closure=None):
        self.log.append("step")
        return super().step(closure)

    def zero_grad(self, set_to_none=True):
        self.log.append("zero_grad")
        super().zero_grad(set_to_none)


def _batches(steps=3, rows=4):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(rows, 3, generator=g) for _ in range(steps)]


def test_rank_slice_hooks_in_order_and_local_losses():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    log, seen = [], []
    opt = _Recorder(model.parameters(), log)

    def loss_fn(m, x):
        seen.append(x.clone())
        log.append("forward")
        return m(x).square().mean()

    batches = _batches()
    losses = train_steps(
        model,
        opt,
        batches,
        1,
        2,
        loss_fn=loss_fn,
        on_first_grads=lambda: log.append(("first_grads", model.weight.grad is not None)),
        after_step=lambda i: log.append(("after_step", i)),
        between=lambda i: log.append(("between", i)),
    )
    # rank 1 of 2: the second half of each global batch
    assert [s.tolist() for s in seen] == [b[2:4].tolist() for b in batches]
    assert log[:6] == [
        "forward",
        ("first_grads", True),
        "step",
        ("after_step", 0),
        "zero_grad",
        ("between", 0),
    ]
    assert log[6:] == ["forward", "step", ("after_step", 1), "zero_grad", ("between", 1)] + [
        "forward",
        "step",
        ("after_step", 2),
        "zero_grad",
        ("between", 2),
    ]
    assert len(losses) == 3 and all(isinstance(v, float) for v in losses)


def test_one_process_equals_the_plain_loop():
    """``world=1`` (a reference): the whole batch, the plain loop's losses and weights."""

    def run(use_helper):
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        if use_helper:
            return train_steps(model, opt, _batches()), model.weight.detach().clone()
        losses = []
        for x in _batches():
            loss = model(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses, model.weight.detach().clone()

    (got, w_got), (want, w_want) = run(True), run(False)
    assert got == want and torch.equal(w_got, w_want)
    # control: a different slice (rank 0 of 2) trains differently
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    half = train_steps(model, torch.optim.SGD(model.parameters(), lr=0.1), _batches(), 0, 2)
    assert half != want
