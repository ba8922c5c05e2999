"""Where `studies` keeps what it reuses between commands on this machine: the warm local Rays
(`studies.running.warm_ray`) and the fused-form probes that passed
(`studies.running.fusion_check`). ``STUDIES_STATE_DIR``, else
``$XDG_CACHE_HOME/setvalued-studies``, else ``~/.cache/setvalued-studies``; deleting it loses
nothing but time."""

from __future__ import annotations

import os
from pathlib import Path

#: the folder of the state kept between commands (default: `state_root`)
STATE_DIR_ENV = "STUDIES_STATE_DIR"


def state_root() -> Path:
    given = os.environ.get(STATE_DIR_ENV)
    if given:
        return Path(given).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "setvalued-studies"
