"""The single-positive multi-label baselines of the average-K study: AN (assume negative),
EPR and ROLE (thesis ch. 5; [GSJS23]; docs/papers.md), and the checks the losses of
`setvalued.losses.avgk` share with them.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from setvalued.losses.base import SetValuedLoss, TwoHeadOutput, fixed_shapes, one_hot, register_loss

# --------------------------------------------------------------------------------------------
# parameter checks
# --------------------------------------------------------------------------------------------


def checked_number(
    name: str, value: Any, low: float, *, integer: bool = False, low_open: bool = False, what: str = ""
) -> float:
    """Check a scalar parameter; raise ValueError naming it and the allowed range."""
    bad = isinstance(value, bool) or not isinstance(value, numbers.Real)
    if not bad:
        bad = not math.isfinite(value) or (integer and int(value) != value)
        bad = bad or (value <= low if low_open else value < low)
    if bad:
        kind = "an integer" if integer else "a finite number"
        bound = f"> {low}" if low_open else f">= {low}"
        raise ValueError(f"{what or 'loss'} parameter {name} must be {kind} {bound}, got {value!r}")
    return int(value) if integer else float(value)


def checked_num_classes(name: str, value: Any) -> int | None:
    if value is None:
        return None
    return int(checked_number("num_classes", value, 1, integer=True, what=name))


def check_logits(name: str, logits: torch.Tensor, targets: torch.Tensor) -> None:
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2:
        raise ValueError(
            f"{name} expects scores of shape (batch, classes), got "
            f"{type(logits).__name__} {tuple(getattr(logits, 'shape', ()))}"
        )
    if logits.shape[0] == 0:
        raise ValueError(f"{name}: the batch is empty")
    if targets.dim() != 1 or targets.shape[0] != logits.shape[0]:
        raise ValueError(f"{name}: targets must have shape ({logits.shape[0]},), got {tuple(targets.shape)}")


def _single_head(name: str, output: Any) -> torch.Tensor:
    if isinstance(output, TwoHeadOutput):
        raise ValueError(f"{name} is a single-head loss; got a two-head output (set model.head to 'linear')")
    return output


# --------------------------------------------------------------------------------------------
# single-positive multi-label baselines (thesis 5.4; [Col+21]; docs/papers.md, note A-N2)
# --------------------------------------------------------------------------------------------


@register_loss("assume_negative")
class AssumeNegativeLoss(SetValuedLoss):
    """Assume Negative (thesis eq. 5.5, [Col+21]'s weighted variant)::

        l_AN(z_i, y_i) = - sum_j [ 1[j=y_i] log sigma(z_ij) + w 1[j!=y_i] log(1 - sigma(z_ij)) ]

    with ``w = negative_weight``, by default 1/(L-1) so that the negatives weigh as much as the
    positive; averaged over the batch (docs/papers.md, note A-N2, [inferred]).  The thesis
    scaling is kept: Cole's code also divides by L (a constant factor).

    ``targets`` are class indices (B,), or an observed-label matrix (B, L) with 1 = observed
    positive, -1 = observed negative (weight 1) and 0 = unobserved, assumed negative (weight w).
    With every label observed (no 0) the loss is plain BCE summed over classes.
    """

    head = "linear"
    requires_indices = False

    def __init__(self, negative_weight: float | None = None, num_classes: int | None = None, reduction: str = "mean"):
        super().__init__(reduction)
        self.negative_weight = (
            None
            if negative_weight is None
            else checked_number("negative_weight", negative_weight, 0, what="assume_negative")
        )
        self.num_classes = checked_num_classes("assume_negative", num_classes)
        if self.num_classes is not None and self.num_classes < 2 and negative_weight is None:
            raise ValueError("assume_negative needs num_classes >= 2 for the default weight 1/(L-1)")

    def forward(self, output: Any, targets: torch.Tensor, indices: torch.Tensor | None = None) -> torch.Tensor:
        logits = _single_head("assume_negative", output)
        if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or logits.shape[0] == 0:
            raise ValueError(
                f"assume_negative expects non-empty scores (batch, classes), got {tuple(getattr(logits, 'shape', ()))}"
            )
        batch, num_classes = logits.shape
        if targets.dim() == 1:
            check_logits("assume_negative", logits, targets)
            # no CPU value copied to the device (issue #34); a label out of range fails, compiled too
            observed = one_hot(targets.to(logits.device), num_classes, torch.long)
        elif targets.shape == logits.shape:
            observed = targets.to(device=logits.device).round().long()
            if not fixed_shapes(observed) and bool(((observed < -1) | (observed > 1)).any()):
                raise ValueError(
                    "assume_negative: a label matrix must hold 1 (positive), -1 (negative), 0 (unobserved)"
                )
        else:
            raise ValueError(
                f"assume_negative: targets must be class indices ({batch},) or a label matrix "
                f"{tuple(logits.shape)}, got {tuple(targets.shape)}"
            )
        weight = self.negative_weight
        if weight is None:
            if num_classes < 2:
                raise ValueError("assume_negative needs at least 2 classes for the weight 1/(L-1)")
            weight = 1.0 / (num_classes - 1)
        zero = torch.zeros((), dtype=logits.dtype, device=logits.device)
        positive = -torch.where(observed == 1, F.logsigmoid(logits), zero)
        log_not_p = F.logsigmoid(-logits)
        negative = -torch.where(observed == -1, log_not_p, zero) - weight * torch.where(observed == 0, log_not_p, zero)
        return self.reduce((positive + negative).sum(dim=1))


@register_loss("epr")
class EPRLoss(SetValuedLoss):
    """Expected Positive Regularization (thesis eqs. 5.7-5.8)::

        K_hat(Z) = 1/|B| sum_i sum_j sigma(z_ij)
        l_EPR^beta = -1/|B| sum_i log sigma(z_{i,y_i}) + beta (K_hat(Z) - K)^2

    Thesis scaling (Cole's code divides the main term by L and the penalty by L^2; a
    multi-decade beta grid covers both; docs/papers.md, note A-N2).  The penalty is a
    batch-level term; with ``reduction="none"`` it is added to every example so that the mean
    is the loss.
    """

    head = "linear"
    requires_indices = False

    def __init__(self, k: float = 5, beta: float = 0.01, reduction: str = "mean"):
        super().__init__(reduction)
        self.k = checked_number("k", k, 0, low_open=True, what="epr")
        self.beta = checked_number("beta", beta, 0, what="epr")

    @staticmethod
    def expected_set_size(logits: torch.Tensor) -> torch.Tensor:
        """K_hat of eq. 5.7: batch mean of the summed sigmoids."""
        return torch.sigmoid(logits).sum(dim=1).mean()

    def penalty(self, logits: torch.Tensor) -> torch.Tensor:
        """beta (K_hat - K)^2 of eq. 5.8."""
        return self.beta * (self.expected_set_size(logits) - self.k) ** 2

    def forward(self, output: Any, targets: torch.Tensor, indices: torch.Tensor | None = None) -> torch.Tensor:
        logits = _single_head("epr", output)
        check_logits("epr", logits, targets)
        targets = targets.to(device=logits.device, dtype=torch.long)
        positive = -F.logsigmoid(logits.gather(1, targets[:, None]))[:, 0]
        return self.reduce(positive + self.penalty(logits))


#: ROLE label-estimate initialisation ([Col+21]'s code; docs/papers.md, note A-N2): unobserved
#: entries uniform in [-logit(0.6), logit(0.6)], observed positives logit(0.995).
ROLE_INIT_UNOBSERVED = math.log(0.6 / 0.4)
ROLE_INIT_POSITIVE = math.log(0.995 / 0.005)


@register_loss("role")
class ROLELoss(SetValuedLoss):
    """Regularized Online Label Estimation ([Col+21]; thesis 5.4.6 gives no formula, so the
    form follows [Col+21]'s code (docs/papers.md, note A-N2) and erratum A-E5 for lambda_).

    The loss owns a label-estimate logit matrix Theta (num_examples, L), ``g = sigma(Theta)``,
    looked up with the batch's training-set indices; ``f = sigma(z)`` is the classifier.  Per batch::

        [ sum_i 0.5 (-log f_{i,y_i} - log g_{i,y_i})
          + sum_{i,j} 0.5 (BCE(f_ij; target sg(g_ij)) + BCE(g_ij; target sg(f_ij))) ] / (|B| L)
        + lambda_ 0.5 (R(f) + R(g)),   R(q) = (1/|B| sum_{i,j} q_ij - K)^2 / L^2

    sg = stop-gradient.  lambda_ weighs the expected-positive regulariser (erratum A-E5; Cole's
    code uses 1, the thesis selects 0.0 on CIFAR-100).  Logs are the stable log-sigmoid forms
    (Cole uses -log(x + 1e-5)).  Theta rows start uniform in [-logit(0.6), logit(0.6)]; the
    label entry of a row is set to logit(0.995) the first time its example is seen (the loss
    does not know the training labels in advance).  The thesis's "learning rate Theta x 1.0"
    is ``lr_multiplier`` (default 1.0), for a trainer that gives Theta its own parameter group;
    no weight decay on Theta [inferred].  Memory: num_examples x L floats (plus optimiser state).
    """

    head = "linear"
    requires_indices = True

    #: which training examples' estimates have been initialised (a buffer)
    seen: torch.Tensor

    def __init__(
        self,
        k: float = 5,
        lambda_: float = 1.0,
        num_examples: int | None = None,
        num_classes: int | None = None,
        lr_multiplier: float = 1.0,
        reduction: str = "mean",
    ):
        super().__init__(reduction)
        self.k = checked_number("k", k, 0, low_open=True, what="role")
        self.lambda_ = checked_number("lambda_", lambda_, 0, what="role")
        self.lr_multiplier = checked_number("lr_multiplier", lr_multiplier, 0, low_open=True, what="role")
        if num_examples is None or num_classes is None:
            raise ValueError(
                "role needs the context keys num_examples (training set size) and "
                f"num_classes, got num_examples={num_examples!r}, num_classes={num_classes!r}"
            )
        self.num_examples = int(checked_number("num_examples", num_examples, 1, integer=True, what="role"))
        self.num_classes = int(checked_number("num_classes", num_classes, 1, integer=True, what="role"))
        init = (torch.rand(self.num_examples, self.num_classes) * 2 - 1) * ROLE_INIT_UNOBSERVED
        #: Theta, the label-estimate logits (a learnable parameter of the loss)
        self.label_logits = nn.Parameter(init)
        self.register_buffer("seen", torch.zeros(self.num_examples, dtype=torch.bool))

    def _regulariser(self, probs: torch.Tensor) -> torch.Tensor:
        return (probs.sum(dim=1).mean() - self.k) ** 2 / self.num_classes**2

    def forward(self, output: Any, targets: torch.Tensor, indices: torch.Tensor | None = None) -> torch.Tensor:
        logits = _single_head("role", output)
        check_logits("role", logits, targets)
        if indices is None:
            raise ValueError("role needs the training-set indices of the batch: loss(output, targets, indices)")
        batch, num_classes = logits.shape
        if num_classes != self.num_classes:
            raise ValueError(f"role was built for num_classes={self.num_classes}, the scores have {num_classes}")
        indices = indices.to(device=self.label_logits.device, dtype=torch.long)
        if indices.shape != (batch,):
            raise ValueError(f"role: indices must have shape ({batch},), got {tuple(indices.shape)}")
        if not fixed_shapes(indices) and (int(indices.min()) < 0 or int(indices.max()) >= self.num_examples):
            raise ValueError(f"role: indices must lie in [0, {self.num_examples - 1}] (num_examples)")
        targets = targets.to(device=logits.device, dtype=torch.long)

        with torch.no_grad():  # first visit: the observed label starts at logit(0.995)
            labels = targets.to(indices.device)
            fresh = ~self.seen[indices]
            if fixed_shapes(indices):  # every entry of the batch written (the old value where
                # the example was seen before): no test read back on the host
                current = self.label_logits[indices, labels]
                self.label_logits.index_put_(
                    (indices, labels), torch.where(fresh, torch.full_like(current, ROLE_INIT_POSITIVE), current)
                )
                self.seen.index_fill_(0, indices, True)
            elif bool(fresh.any()):
                self.label_logits[indices[fresh], labels[fresh]] = ROLE_INIT_POSITIVE
                self.seen[indices[fresh]] = True

        theta = self.label_logits[indices].to(logits.device)
        f, g = torch.sigmoid(logits), torch.sigmoid(theta)
        log_f, log_not_f = F.logsigmoid(logits), F.logsigmoid(-logits)
        log_g, log_not_g = F.logsigmoid(theta), F.logsigmoid(-theta)
        rows = torch.arange(batch, device=logits.device)
        positive = 0.5 * (-log_f[rows, targets] - log_g[rows, targets])
        f_to_g = -(g.detach() * log_f + (1 - g.detach()) * log_not_f)
        g_to_f = -(f.detach() * log_g + (1 - f.detach()) * log_not_g)
        cross = 0.5 * (f_to_g + g_to_f).sum(dim=1)
        regulariser = self.lambda_ * 0.5 * (self._regulariser(f) + self._regulariser(g))
        return self.reduce((positive + cross) / num_classes + regulariser)
