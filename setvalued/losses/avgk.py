"""Average-K losses: the two-head loss of Garcin et al. and the single-positive multi-label
baselines AN, EPR and ROLE (thesis ch. 5; [GSJS23], S2 = its supplement; docs/papers.md).

Notation: L classes, batch B with |B| examples, z_i the logits of example i, y_i its label,
sigma the sigmoid, varsigma the softmax.  Logs of sigmoids use the stable forms
``log sigma(z) = logsigmoid(z)`` and ``log(1 - sigma(z)) = logsigmoid(-z)``.

Every loss's ``prediction_scores(output)`` returns raw logits of the head that is evaluated;
whether softmax or sigmoid is put on them before the average-K threshold is an evaluation option
(docs/papers.md, erratum A-E4; ``setvalued.metrics.activate``).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from setvalued.losses.base import SetValuedLoss, TwoHeadOutput, fixed_shapes, register_loss
from setvalued.losses.single_positive import (
    ROLE_INIT_POSITIVE,
    ROLE_INIT_UNOBSERVED,
    AssumeNegativeLoss,
    EPRLoss,
    ROLELoss,
    check_logits,
    checked_num_classes,
    checked_number,
)

__all__ = [
    "TwoHeadClassifier",
    "candidate_indices",
    "candidate_masks",
    "AvgKTwoHeadLoss",
    "AssumeNegativeLoss",
    "EPRLoss",
    "ROLELoss",
    "ROLE_INIT_POSITIVE",
    "ROLE_INIT_UNOBSERVED",
]


# --------------------------------------------------------------------------------------------
# two-head model wrapper and loss (thesis 5.5.2, eqs. 5.10-5.15)
# --------------------------------------------------------------------------------------------


class TwoHeadClassifier(nn.Module):
    """Two independent linear heads on shared features H (thesis 5.5.2).

    ``ml``: Z = H W, the multi-label head trained with the BCE of eq. 5.14 (the prediction head
    at test time); ``sccp``: Z' = H W', the set-candidate-classes-proposal head trained with CE
    (eq. 5.10).  The thesis writes H W without a bias; a bias is harmless (docs/papers.md, note
    A-N1) and on by default.
    """

    def __init__(self, in_features: int, num_classes: int, bias: bool = True):
        super().__init__()
        if in_features < 1 or num_classes < 1:
            raise ValueError(f"in_features and num_classes must be >= 1, got {in_features}, {num_classes}")
        self.in_features = in_features
        self.num_classes = num_classes
        self.sccp = nn.Linear(in_features, num_classes, bias=bias)
        self.ml = nn.Linear(in_features, num_classes, bias=bias)

    def forward(self, features: torch.Tensor) -> TwoHeadOutput:
        return TwoHeadOutput(sccp=self.sccp(features), ml=self.ml(features))


#: Up to this many entries one selection over all of them is cheaper than the group bound
#: (measured on CPU, B = 128: L = 100 yes, L = 1000 no).
_DIRECT_SELECTION_ENTRIES = 32768


def _group_members(total: int, count: int) -> int:
    """Classes per group for :func:`_largest_entries`: about 10 while the count is a small
    share of the entries, fewer (down to 4) as it grows (measured, B = 128, L in {100, 1000})."""
    return min(10, max(4, total // (8 * count)))


def _reaching_groups(group_max: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(groups, bound)``: a bound at most the count-th largest group maximum (so at most the
    count-th largest entry) and every group whose maximum reaches it.

    Few groups wanted (count x 64 <= groups): the ``count`` top groups of one selection (a
    partial sort), all groups at the bound when others tie with them.  Many: a selection over
    all maxima costs several times more per entry, so the bound is a quantile of a strided
    sample of the maxima, taken low enough (three standard deviations of the sample count) that
    at least ``count`` maxima reach it, which one count checks (else the exact count-th largest).
    """
    total = group_max.numel()
    if count * 64 <= total:
        top_maxima, groups = torch.topk(group_max, count, sorted=False)
        bound = top_maxima.min()
        if int((group_max >= bound).sum()) > count:  # groups tied at the bound: list them all
            groups = (group_max >= bound).nonzero().squeeze(1)
        return groups, bound
    stride = 8
    sample = group_max[::stride]
    expected = count / stride
    rank = min(sample.numel(), int(expected + 3.0 * math.sqrt(expected)) + 1)  # rank-th largest
    bound = torch.kthvalue(sample, sample.numel() - rank + 1).values
    reaching = group_max >= bound
    if int(reaching.sum()) < count:  # the sample was unlucky: the exact count-th largest
        bound = torch.kthvalue(group_max, total - count + 1).values
        reaching = group_max >= bound
    return reaching.nonzero().squeeze(1), bound


def _largest_entries(values: torch.Tensor, count: int) -> torch.Tensor:
    """Flat (row-major) indices of the ``count`` largest entries of a 2-D tensor, in no
    particular order; ties at the threshold are broken by flat position (lower first).

    No sort of the B L entries, and no selection over all of them: the columns are read as P
    strided groups (class ``p G + g`` in group g) and ``bound``, the count-th largest of the
    B G group maxima, is a lower bound of the count-th largest entry (the group maxima are
    some of the entries).  Every entry at least the threshold is therefore in a group whose
    maximum reaches ``bound``: the ``count`` top groups of the selection over the maxima, unless
    other groups tie with them at ``bound`` (then all groups reaching it are listed).  One
    selection over those groups' entries (about count x P) gives the count largest.  The tie
    rule is applied afterwards on the few entries equal to the threshold, so the result is the
    first ``count`` positions of a stable descending sort.

    On a GPU and under ``torch.compile`` (:func:`~setvalued.losses.base.fixed_shapes`: the
    group bound reads counts back on the host) it is that sort itself: one stable descending
    sort of the B L entries, the same entries in another order.
    """
    values = values.contiguous()
    rows, cols = values.shape
    total = rows * cols
    device = values.device
    if count <= 0:
        return torch.zeros(0, dtype=torch.long, device=device)
    if count >= total:
        return torch.arange(total, device=device)
    if fixed_shapes(values):
        return torch.sort(values.view(-1), descending=True, stable=True).indices[:count]
    pool, where = values.reshape(-1), None
    members = _group_members(total, count)
    groups = -(-cols // members)
    if total > _DIRECT_SELECTION_ENTRIES and members > 1 and rows * groups >= count:
        padded = values if members * groups == cols else F.pad(values, (0, members * groups - cols), value=-math.inf)
        group_max = padded.view(rows, members, groups).amax(dim=1).view(-1)
        reaching, bound = _reaching_groups(group_max, count)  # row * G + group
        if bool(bound > -math.inf):  # else the padding could be chosen: select over everything
            row = torch.div(reaching, groups, rounding_mode="floor")
            first = reaching.add(row * (cols - groups))  # flat index of the group's member 0
            where = (first.unsqueeze(1) + torch.arange(0, members * groups, groups, device=device)).view(-1)
            if members * groups != cols:  # members past the last class read the padding (-inf)
                shift = (row * (members * groups - cols)).unsqueeze(1).expand(-1, members).reshape(-1)
                pool = padded.reshape(-1).index_select(0, where + shift)
            else:
                pool = pool.index_select(0, where)
    top_values, positions = torch.topk(pool, count, sorted=False)
    threshold = top_values.min()
    tied_in_top = int((top_values == threshold).sum())
    if int((pool == threshold).sum()) > tied_in_top:  # ties cut by the threshold: lower first
        tied = (pool == threshold).nonzero().squeeze(1)
        if where is not None:
            tied = where[tied]
        above = positions[top_values > threshold]
        first_tied = torch.sort(tied).values[:tied_in_top]
        return torch.cat([above if where is None else where[above], first_tied])
    return positions if where is None else where.index_select(0, positions)


def _masked_log_probs(sccp_logits: torch.Tensor, targets: torch.Tensor, log_probs: torch.Tensor | None) -> torch.Tensor:
    """Detached ``log varsigma(Z')`` (float32 at least) with -inf at the labels (eq. 5.11)."""
    if log_probs is None:
        logits = sccp_logits.detach()
        if logits.dtype in (torch.float16, torch.bfloat16):
            logits = logits.float()
        log_probs = torch.log_softmax(logits, dim=1)
    masked = log_probs.detach().clone()
    masked.scatter_(1, targets.unsqueeze(1), -math.inf)
    return masked


def candidate_indices(
    sccp_logits: torch.Tensor, targets: torch.Tensor, k: int, log_probs: torch.Tensor | None = None
) -> torch.Tensor:
    """Flat (row-major) indices into the (|B|, L) batch matrix of the candidates ``S_c`` of
    thesis eq. 5.12: the (k-1)|B| largest entries of the whole masked matrix of eq. 5.11.

    The entries are ranked by the log-softmax ``log varsigma(Z')`` (the order of the softmax;
    ``log_probs`` may pass it in), in the logits' precision (float32 at least): log-probabilities
    do not underflow, so the small probabilities of a long tail stay distinct.  Ties at the
    threshold are broken by flat position (lower example index first, then lower class index):
    eq. 5.12 does not order equal probabilities, but eq. 5.13 needs exactly (k-1)|B| candidates,
    so that the mean set size is K on every batch; any rule that takes exactly that many keeps
    the paper's loss, and this one is deterministic.  No gradient (the choice is discrete).
    """
    with torch.no_grad():
        masked = _masked_log_probs(sccp_logits, targets, log_probs)
        return _largest_entries(masked, (k - 1) * masked.shape[0])


@torch.no_grad()
def candidate_masks(
    sccp_logits: torch.Tensor, targets: torch.Tensor, k: int, log_probs: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Bool masks (positive, candidate, negative), each (|B|, L), of thesis eqs. 5.11-5.14.

    positive: ``j = y_i``.  candidate ``S_c``: :func:`candidate_indices` (the (k-1)|B| largest
    entries of the **whole** masked batch matrix, from the detached SCCP softmax).  negative:
    ``j not in S(x_i) = {y_i} u S_c(x_i)`` (docs/papers.md, erratum A-E1: the label is excluded
    too), exactly (L-k)|B| entries.
    """
    batch, num_classes = sccp_logits.shape
    device = sccp_logits.device
    # scatter_ and index_fill_ of a Python value: an indexed write of one would copy a CPU
    # value to the device, blocking (issue #34)
    positive = torch.zeros(batch, num_classes, dtype=torch.bool, device=device).scatter_(1, targets.unsqueeze(1), True)
    candidate = torch.zeros(batch * num_classes, dtype=torch.bool, device=device)
    candidate.index_fill_(0, candidate_indices(sccp_logits, targets, k, log_probs), True)
    candidate = candidate.view(batch, num_classes)
    return positive, candidate, ~(positive | candidate)


def _chunk_size(num_classes: int) -> int:
    """Largest divisor of L in [1, 100]: rows are multiplied in chunks of that many entries."""
    return max(d for d in range(1, 101) if num_classes % d == 0)


def _row_sum_log(folded: torch.Tensor) -> torch.Tensor:
    """``sum_j log f_ij`` per row for entries ``f`` in [1/2, 1] (here ``sigma(|z|)``): a product
    of up to 100 of them stays above 2^-100 (no underflow in float32), so one log per chunk
    replaces one log per entry."""
    batch, num_classes = folded.shape
    chunk = _chunk_size(num_classes)
    if chunk < 16:  # few divisors: pad with ones (log 1 = 0) to chunks of 64
        chunk = 64
        folded = F.pad(folded, (0, -num_classes % chunk), value=1.0)
    return folded.view(batch, -1, chunk).prod(dim=2).log_().sum(dim=1)


def _working(logits: torch.Tensor) -> torch.Tensor:
    """Contiguous logits (row-major: flat indices and chunked views), half precision upcast to
    float32 (the candidates are ranked in float32 at least, as in :func:`candidate_indices`)."""
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    return logits.contiguous()


class _TwoHeadLoss(torch.autograd.Function):
    """Per-example ``l_CE(z'_i, y_i) + sum_j w_ij BCE(z_ij, t_ij)`` (thesis eqs. 5.10-5.15) as one
    autograd node with a closed-form backward: few passes over B x L, few fresh B x L tensors
    (on CPU each costs page faults) and few small operations (each costs a dispatch).

    CE (eq. 5.10): ``-log varsigma(z')_y`` from one log-softmax, whose output also ranks the
    candidates (eq. 5.11: the labels masked to -inf in place); gradient ``go_i (varsigma(z'_i) -
    e_y)``, written over the log-softmax buffer (``exp``; ``expm1`` at the label, exact when
    p_y ~ 1).

    BCE (eq. 5.14): every entry is a negative (``t = 0``, weight ``w_neg = alpha/(L-K)``) except
    the labels (``t = 1``, weight 1) and the candidates (``t = 1``, weight ``alpha/(K-1)``), so the
    row sum is the dense ``w_neg sum_j softplus(z_ij)`` plus a correction on those positives.
    ``softplus(z) = max(z, 0) - log sigma(|z|)`` (no overflow, no log of 0; the logs taken per
    chunk: :func:`_row_sum_log`); at a positive ``w_pos softplus(-z) = w_pos (softplus(z) - z)``
    replaces ``w_neg softplus(z)``.  Gradient ``w (sigma(z) - t)``, written over the sigmoid
    buffer of the forward pass; ``-w sigma(-z)`` at the positives (exact where sigma(z) rounds
    to 1).

    The candidates are a discrete choice (no gradient through them).  The buffers kept for the
    backward pass become the gradients; a second backward pass (``retain_graph=True``)
    recomputes them from the saved inputs.
    """

    @staticmethod
    def forward(ctx: Any, sccp: Any, ml: Any, targets: Any, k: Any, alpha: Any) -> torch.Tensor:
        batch, num_classes = ml.shape
        column = targets.unsqueeze(1)
        log_probs = torch.log_softmax(sccp, dim=1)
        label_log_probs = log_probs.gather(1, column)
        log_probs.scatter_(1, column, -math.inf)  # eq. 5.11: a label is never a candidate
        candidates = _largest_entries(log_probs, (k - 1) * batch)  # eq. 5.12
        labels = torch.arange(0, batch * num_classes, num_classes, device=ml.device).add_(targets)
        positives = torch.cat([labels, candidates])
        weights = torch.full(positives.shape, alpha / (k - 1), dtype=ml.dtype, device=ml.device)
        weights[:batch] = 1.0
        negative_weight = alpha / (num_classes - k)

        sigmoid = torch.sigmoid(ml)
        folded = torch.sub(sigmoid, 0.5).abs_().add_(0.5)  # sigma(|z|), in [1/2, 1]
        z = ml.view(-1).index_select(0, positives)
        softplus = folded.view(-1).index_select(0, positives).log_().neg_().add_(z.clamp_min(0.0))
        log_folded = _row_sum_log(folded)
        per_row = torch.clamp_min(ml, 0.0, out=folded).sum(dim=1).sub_(log_folded)  # sum softplus
        per_row.mul_(negative_weight).sub_(label_log_probs.squeeze(1))
        correction = torch.addcmul(softplus.mul_(weights - negative_weight), z, weights, value=-1.0)
        rows = torch.div(positives, num_classes, rounding_mode="floor")
        per_row.index_add_(0, rows, correction)

        ctx.save_for_backward(sccp, ml, targets, positives, rows)
        ctx.buffers = (log_probs, sigmoid)
        ctx.label_log_probs = label_log_probs
        ctx.positive_grad = torch.sigmoid(z.neg_()).mul_(weights).neg_()  # w (sigma(z) - 1)
        ctx.negative_weight = negative_weight
        return per_row

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        sccp, ml, targets, positives, rows = ctx.saved_tensors
        if ctx.buffers is None:  # a second backward pass: the first one wrote over the buffers
            log_probs, sigmoid = torch.log_softmax(sccp, dim=1), torch.sigmoid(ml)
        else:
            (log_probs, sigmoid), ctx.buffers = ctx.buffers, None
        scale = grad_output.unsqueeze(1)
        grad_sccp = log_probs.exp_().mul_(scale)  # exp(log_probs) = softmax
        grad_sccp.scatter_(1, targets.unsqueeze(1), torch.expm1(ctx.label_log_probs).mul_(scale))
        grad_ml = sigmoid.mul_(scale * ctx.negative_weight)
        grad_ml.view(-1).index_copy_(0, positives, ctx.positive_grad * grad_output.index_select(0, rows))
        return grad_sccp, grad_ml, None, None, None


@register_loss("avgk_two_head")
class AvgKTwoHeadLoss(SetValuedLoss):
    """``l_AVG^{K,alpha} = l_CE(Z', Y) + l_BCE(Z, Y, S_c)`` (thesis eq. 5.15 with erratum A-E2:
    the CE term is on the SCCP logits Z'), with (eq. 5.14, erratum A-E1)::

        l_BCE = - 1/|B|            sum_{i,j} 1[j = y_i]      log sigma(z_ij)
                - alpha/((K-1)|B|) sum_{i,j} 1[j in S_c(x_i)] log sigma(z_ij)
                - alpha/((L-K)|B|) sum_{i,j} 1[j not in S(x_i)] log(1 - sigma(z_ij))

    ``|B|`` is the actual batch size (a short last batch stays consistent; docs/papers.md, note
    A-N1).  The candidates come from the detached SCCP softmax (:func:`candidate_masks`), so the
    SCCP head gets gradient only from CE and the ML head only from the BCE.
    ``reduction="none"`` returns per-example values whose mean is the loss: example i carries
    its CE, its label term and alpha/(K-1) resp. alpha/(L-K) times its own candidate and
    negative terms.

    Parameters: ``k`` (integer >= 2; K = 1 has no candidates, docs/papers.md, note A-N1),
    ``alpha >= 0`` (weight of the pseudo-labels), ``prediction_head`` in {"ml", "sccp"} (S2
    appendix C).
    """

    head = "two_head"
    requires_indices = False

    def __init__(
        self,
        k: int = 5,
        alpha: float = 1.0,
        prediction_head: str = "ml",
        num_classes: int | None = None,
        reduction: str = "mean",
    ):
        super().__init__(reduction)
        self.k = checked_number("k", k, 2, integer=True, what="avgk_two_head")
        self.alpha = checked_number("alpha", alpha, 0, what="avgk_two_head")
        if prediction_head not in ("ml", "sccp"):
            raise ValueError(f"avgk_two_head parameter prediction_head must be 'ml' or 'sccp', got {prediction_head!r}")
        self.prediction_head = prediction_head
        self.num_classes = checked_num_classes("avgk_two_head", num_classes)
        if self.num_classes is not None:
            self._check_fits(1, self.num_classes)

    def _check_fits(self, batch: int, num_classes: int) -> None:
        """A batch of |B| x L entries must hold the (k-1)|B| candidates among its |B|(L-1)
        non-label entries and leave at least one negative: (L-k)|B| >= 1, i.e. k < L."""
        available = batch * (num_classes - 1)
        needed = (self.k - 1) * batch
        if needed + 1 > available:
            raise ValueError(
                f"avgk_two_head parameter k={self.k} needs (k-1)|B| = {needed} candidates plus at "
                f"least one negative, but a batch of |B|={batch} examples over L={num_classes} classes "
                f"has only {available} non-label entries; k must be < L = {num_classes}"
            )

    def forward(self, output: Any, targets: torch.Tensor, indices: torch.Tensor | None = None) -> torch.Tensor:
        if not isinstance(output, TwoHeadOutput):
            raise ValueError(
                "avgk_two_head needs a TwoHeadOutput(sccp=..., ml=...) from a two-head model (model.head: two_head)"
            )
        sccp, ml = output.sccp, output.ml
        check_logits("avgk_two_head", ml, targets)
        if sccp.shape != ml.shape:
            raise ValueError(
                f"avgk_two_head: the heads differ in shape: sccp {tuple(sccp.shape)}, ml {tuple(ml.shape)}"
            )
        batch, num_classes = ml.shape
        self._check_fits(batch, num_classes)
        targets = targets.to(device=ml.device, dtype=torch.long)
        per_example = _TwoHeadLoss.apply(_working(sccp), _working(ml), targets, self.k, self.alpha)
        return self.reduce(per_example)

    def prediction_scores(self, output: Any) -> torch.Tensor:
        if not isinstance(output, TwoHeadOutput):
            raise ValueError("avgk_two_head needs a TwoHeadOutput(sccp=..., ml=...)")
        return output.ml if self.prediction_head == "ml" else output.sccp
