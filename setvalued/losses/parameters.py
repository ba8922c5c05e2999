"""What every registered loss accepts: its parameters with their types, defaults and ranges.

One entry per registry name, in the order of the loss's constructor. ``build_loss`` checks the
given values against it before building the loss, the study-file validation reads it to check
a study without building anything (and without importing torch: this module imports nothing
of PyTorch), and registering a loss checks that its constructor takes exactly these
parameters. The context keys the trainer passes (``class_counts``, ``num_classes``,
``num_examples``) and ``reduction`` are not parameters of a study.

The ranges follow the papers: k >= 1 for the top-K losses (and k < L, checked against the
classes when they are known), k >= 2 for the two-head average-K loss (K = 1 has no candidate
pseudo-labels, thesis eq. 5.14), temperatures, margins and weights >= 0, scales > 0.
"""

from __future__ import annotations

from setvalued.params import Param

__all__ = ["LOSS_PARAMETERS", "CONTEXT_KEYS", "MULTI_LABEL_LOSSES"]

#: keys the trainer passes to every loss; a loss that does not use them ignores them
CONTEXT_KEYS = ("class_counts", "num_classes", "num_examples")

_K_TOPK = Param("int", 5, "the K of top-K", low=1)
_EPSILON = "noise scale of the smoothed (k+1)-th largest score (thesis eq. 4.10)"
_N_SAMPLES = Param("int", 5, "M, the number of noise draws per example", low=1)
_EXACT = Param(
    "bool",
    False,
    "draw noise for every class (else, in eager CPU runs, only for the classes "
    "that can reach the top K+1, exact but for a probability below 1e-9 per "
    "example; on a GPU and under torch.compile every class)",
    implicit=True,
)

LOSS_PARAMETERS: dict[str, dict[str, Param]] = {
    "ce": {},
    "focal": {
        "gamma": Param("float", 2.0, "focusing exponent of (1 - p_y)^gamma", low=0.0),
    },
    "ldam": {
        "max_margin": Param("float", 0.5, "largest class margin, in cosine units", low=0.0),
        "scale": Param("float", 30.0, "inverse temperature of the cosine scores", low=0.0, low_open=True),
    },
    "hinge_topk": {"k": _K_TOPK},
    "cvx_hinge_topk": {"k": _K_TOPK},
    "calibrated_hinge_topk": {"k": _K_TOPK},
    "noised_topk": {
        "k": _K_TOPK,
        "epsilon": Param("float", 1.0, _EPSILON, low=0.0),
        "n_samples": _N_SAMPLES,
        "exact": _EXACT,
    },
    "noised_topk_imbalanced": {
        "k": _K_TOPK,
        "epsilon": Param("float", 0.01, _EPSILON, low=0.0),
        "n_samples": _N_SAMPLES,
        "max_margin": Param("float", 0.2, "largest LDAM class margin, in cosine units", low=0.0),
        "scale": Param("float", 50.0, "multiplier of the whole hinge", low=0.0, low_open=True),
        "exact": _EXACT,
    },
    "smooth_topk_svm": {
        "k": _K_TOPK,
        "tau": Param("float", 1.0, "temperature; 0 is the hard loss of [BZK18] eq. 8", low=0.0),
        "alpha": Param("float", 1.0, "margin", low=0.0),
        "hard_switch": Param("bool", False, "use the hard loss where the smooth one is numerically hard"),
    },
    "avgk_two_head": {
        "k": Param("int", 5, "the average set size K", low=2),
        "alpha": Param("float", 1.0, "weight of the candidate pseudo-labels", low=0.0),
        "prediction_head": Param("str", "ml", "the head whose scores are ranked", options=("ml", "sccp")),
    },
    "assume_negative": {
        "negative_weight": Param(
            "float", None, "weight of an unobserved label (default 1/(L-1))", low=0.0, nullable=True
        ),
    },
    "epr": {
        "k": Param("float", 5, "expected number of positive labels", low=0.0, low_open=True),
        "beta": Param("float", 0.01, "weight of the expected-positive penalty", low=0.0),
    },
    "role": {
        "k": Param("float", 5, "expected number of positive labels", low=0.0, low_open=True),
        "lambda_": Param("float", 1.0, "weight of the expected-positive regulariser", low=0.0),
        "lr_multiplier": Param(
            "float", 1.0, "learning rate of the label estimates, as a multiple of optim.lr", low=0.0, low_open=True
        ),
    },
    "sparse_top": {},
    "bce": {},
}

#: the losses that take multi-hot (B, L) targets, for multi-label data (``setvalued.label_kinds``);
#: they take class indices too
MULTI_LABEL_LOSSES = ("sparse_top", "bce")
