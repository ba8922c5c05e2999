"""Set-valued classification losses, built by name: ``build_loss(name, **params)``.

Importing this package registers every loss of the submodules.
"""

from setvalued.losses.base import (  # noqa: F401
    LOSSES,
    SetValuedLoss,
    TwoHeadOutput,
    build_loss,
    loss_parameters,
    register_loss,
)

# Each submodule registers its losses on import.
from setvalued.losses import topk  # noqa: F401,E402
from setvalued.losses import smooth_svm  # noqa: F401,E402
from setvalued.losses import avgk  # noqa: F401,E402
from setvalued.losses.normed import NormedLinear  # noqa: F401,E402
