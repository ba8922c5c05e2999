"""The members' losses of a fused array in one call (``SetValuedLoss.member_losses``, issue 35):
for every loss, each member's value and gradient equal its own call on its slice under its own
random state (float64), on the fused paths (per-example losses on N x B rows; the noised top-K
losses with each member's noise drawn under its state) and on the per-member fallback (the
pruned noised draw, whose shape depends on the scores; the two-head loss, whose candidates are
chosen over the whole batch); a member with NaN scores gets a NaN loss alone."""

from __future__ import annotations

import pytest
import torch

from setvalued.fused.step import RandomState, interchangeable
from setvalued.losses import TwoHeadOutput, build_loss
from setvalued.losses.base import SetValuedLoss, loop_member_losses

MEMBERS, BATCH = 3, 12

#: (loss parameters, classes, whether the fused path is taken: not the per-member loop)
CASES = {
    "ce": ({"name": "ce"}, 10, True),
    "focal": ({"name": "focal", "gamma": 2.0}, 10, True),
    "smooth_topk_svm": ({"name": "smooth_topk_svm", "k": 3, "tau": 1.0, "alpha": 1.0}, 10, True),
    "bce": ({"name": "bce"}, 10, True),
    "noised_topk": ({"name": "noised_topk", "k": 3, "epsilon": 0.5, "n_samples": 4}, 10, True),
    "noised_topk_eps0": ({"name": "noised_topk", "k": 3, "epsilon": 0.0, "n_samples": 4}, 10, True),
    "noised_topk_exact": ({"name": "noised_topk", "k": 2, "epsilon": 0.02, "n_samples": 5, "exact": True}, 300, True),
    # 300 classes, k + 1 = 3, M L = 1500: the CPU path may prune, so its draw's shape depends
    # on the scores: one call per member
    "noised_topk_pruned": ({"name": "noised_topk", "k": 2, "epsilon": 0.02, "n_samples": 5}, 300, False),
    "noised_topk_imbalanced": ({"name": "noised_topk_imbalanced", "k": 3, "epsilon": 0.1, "n_samples": 3}, 10, True),
    "avgk_two_head": ({"name": "avgk_two_head", "k": 3}, 10, False),
}


def make_loss(params: dict, classes: int) -> SetValuedLoss:
    params = dict(params)
    return build_loss(
        params.pop("name"), **params, num_classes=classes, class_counts=list(range(1, classes + 1)), num_examples=100
    )


def member_states(seeds):
    """One ``RandomState`` per member, holding the state that ``torch.manual_seed(seed)`` gives."""
    states = []
    for seed in seeds:
        torch.manual_seed(seed)
        state = RandomState(torch.device("cpu"))
        with state.active():
            pass
        states.append(state)
    return states


@pytest.fixture(autouse=True)
def float64():
    dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(dtype)


@pytest.mark.parametrize("case", list(CASES))
def test_member_losses_equal_each_members_own_call(case):
    params, classes, fused = CASES[case]
    loss = make_loss(params, classes)
    gen = torch.Generator().manual_seed(7)
    heads = 2 if isinstance(loss, type(build_loss("avgk_two_head", k=3))) else 1
    raw = [(3 * torch.randn(MEMBERS, BATCH, classes, generator=gen)).requires_grad_() for _ in range(heads)]
    raw[0].data[1, 4] = float("nan")  # member 1's scores hold a NaN: its loss alone is NaN
    targets = torch.randint(classes, (MEMBERS, BATCH), generator=gen)
    indices = torch.arange(MEMBERS * BATCH).view(MEMBERS, BATCH)
    output = TwoHeadOutput(*raw) if heads == 2 else raw[0]

    seeds = [11, 12, 13]
    calls = []
    original = SetValuedLoss.__call__
    SetValuedLoss.__call__ = lambda self, *a, **k: calls.append(1) or original(self, *a, **k)
    try:
        states = member_states(seeds)
        values = loss.member_losses(output, targets, indices, [s.active(loss.draws_torch_only) for s in states])
    finally:
        SetValuedLoss.__call__ = original
    assert (len(calls) < MEMBERS) == fused  # the fused path: fewer calls than members
    values[[0, 2]].sum().backward()
    fused_grads = [t.grad.clone() for t in raw]

    for i, seed in enumerate(seeds):
        mine = [t.detach()[i].clone().requires_grad_() for t in raw]
        torch.manual_seed(seed)
        own = loss(TwoHeadOutput(*mine) if heads == 2 else mine[0], targets[i], indices[i])
        # the draws are the member's own: its state moved on as its separate call's did
        assert torch.equal(states[i].saved[2], torch.get_rng_state())
        if i == 1:
            assert torch.isnan(own.detach()) and torch.isnan(values[1].detach())
            continue
        assert torch.isfinite(values[i])
        assert abs(float(values[i].detach()) - float(own.detach())) <= 1e-12 * max(1.0, abs(float(own.detach())))
        own.backward()
        for fused_grad, t in zip(fused_grads, mine):
            assert torch.allclose(fused_grad[i], t.grad, rtol=1e-12, atol=1e-14)


def test_a_failed_member_is_not_computed_by_the_loop_and_losses_with_member_state_are_not_shared():
    loss = make_loss({"name": "avgk_two_head", "k": 3}, 10)
    output = TwoHeadOutput(torch.randn(2, 4, 10), torch.randn(2, 4, 10))
    values = loop_member_losses(
        [loss, loss], output, torch.zeros(2, 4, dtype=torch.long), None, [None, member_states([1])[0].active()]
    )
    assert float(values[0]) == 0.0 and float(values[1]) > 0
    role = [make_loss({"name": "role"}, 10) for _ in range(2)]
    assert not interchangeable(role)  # its label estimates are each member's parameters
    ldam = [build_loss("ldam", class_counts=counts, num_classes=3) for counts in ([5, 6, 7], [5, 6, 8])]
    assert not interchangeable(ldam)  # margins from seed-dependent class counts
    assert interchangeable([make_loss(CASES["noised_topk"][0], 10) for _ in range(3)])


@pytest.mark.parametrize("case", ["ce", "smooth_topk_svm", "noised_topk", "noised_topk_pruned", "avgk_two_head"])
def test_member_losses_add_no_host_synchronisation_on_the_gpu_path(case):
    """On fake CUDA tensors (``tests.gpu_audit``) the members' losses in one call read
    nothing back on the host (on the GPU the noised draw has a fixed shape: the fused path)."""
    import contextlib

    from tests.gpu_audit import SyncAudit, claim_cuda, fake_cuda

    params, classes, _ = CASES[case]
    loss = make_loss(params, classes)
    audit = SyncAudit()
    with fake_cuda() as mode:
        claim_cuda(loss, mode)
        parts = [torch.randn(MEMBERS, BATCH, classes, device="cuda") for _ in range(2)]
        output = TwoHeadOutput(*parts) if loss.head == "two_head" else parts[0]
        targets = torch.randint(0, classes, (MEMBERS, BATCH), device="cuda")
        with audit:
            loss.member_losses(output, targets, None, [contextlib.nullcontext() for _ in range(MEMBERS)])
    assert [str(s) for s in audit.syncs] == []


def test_a_subclass_that_overrides_the_computation_is_not_fused_on_its_parents_word():
    """A plugin deriving from a fused loss but computing its own value (here a batch-level
    term) runs once per member: each member's value stays its own call's."""
    from setvalued.losses.topk import CrossEntropy, NoisedTopK

    class BatchLevel(CrossEntropy):
        def forward(self, output, targets, indices=None):
            return super().forward(output, targets) + output.mean() ** 2

    class Reweighted(NoisedTopK):
        def per_sample(self, scores, targets, noise=None):
            return 2 * super().per_sample(scores, targets, noise)

    scores = torch.randn(MEMBERS, BATCH, 10)
    targets = torch.randint(10, (MEMBERS, BATCH))
    for loss in (BatchLevel(), Reweighted(k=3, epsilon=0.5, n_samples=4)):
        states = member_states([1, 2, 3])
        values = loss.member_losses(scores, targets, None, [s.active() for s in states])
        for i, seed in enumerate([1, 2, 3]):
            torch.manual_seed(seed)
            assert abs(float(values[i]) - float(loss(scores[i], targets[i]))) <= 1e-12
