"""What the plugin registers: each entry point of pyproject.toml names one of these.

Pure Python (no torch): a study file is validated from these declarations alone; the
``factory`` paths are imported only by the trainer.
"""

from setvalued.params import Param
from setvalued.registry import Declaration

LS_TOPK_HINGE = Declaration(
    parameters={
        "k": Param("int", 5, "the K of top-K", low=1),
        "smoothing": Param(
            "float",
            0.1,
            "label smoothing: the share of the hinge spread over all classes",
            low=0.0,
            high=1.0,
            high_open=True,
        ),
        "margin": Param("float", 1.0, "margin of the hinge", low=0.0),
    },
    factory="setvalued_example_plugin.loss:LabelSmoothedTopKHinge",
    doc="top-K hinge (Lapin et al. 2015) under a label-smoothed target (Szegedy et al. 2016)",
)

TOY_RINGS = Declaration(
    parameters={
        "num_classes": Param("int", 12, "number of classes (rings x sectors)", low=2),
        "train_size": Param("int", 1200, "training examples", low=10),
        "val_size": Param("int", 300, "validation examples", low=1),
        "test_size": Param("int", 600, "test examples", low=1),
        "noise": Param("float", 0.15, "standard deviation of the point noise", low=0.0),
        "split_seed": Param("int", 7, "seeds the data (not the trial seed)", low=0),
    },
    factory="setvalued_example_plugin.data:build",
    doc="points on concentric rings cut into sectors, in 8 dimensions: neighbours overlap",
)

RESIDUAL_MLP = Declaration(
    parameters={
        "width": Param("int", 64, "units of every layer", low=1),
        "blocks": Param("int", 2, "residual blocks", low=0, high=16),
    },
    factory="setvalued_example_plugin.model:ResidualMLP",
    doc="an MLP with residual blocks (flattens its input)",
)
