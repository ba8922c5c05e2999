"""What trained a study's finished cells, as the report shows it: where their environments and
identities agree or differ, the cells kept knowingly, the driver's environment manifest.

Read from what `studies.tracking.provenance` writes (the layout of `analysis.layout`): each cell
run's `TAG_ENVIRONMENT` and `TAG_IDENTITY`, the parent run's `TAG_KEPT` and its
`ENVIRONMENT_ARTIFACT` (read back as a regular file of bounded size holding a JSON object).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from analysis.layout import ENVIRONMENT_ARTIFACT, TAG_ENVIRONMENT, TAG_IDENTITY, TAG_KEPT

#: the environment keys the report names, in its order
ENVIRONMENT_KEYS = ("host", "python", "torch", "cuda", "cudnn", "gpu", "driver", "device", "cudnn_benchmark")
#: the largest manifest read back (bytes)
MAX_MANIFEST_BYTES = 4 * 2**20
#: the values listed per key where cells differ (then how many more)
MAX_VALUES = 6


def _json(text: Any) -> Any:
    try:
        return json.loads(text) if isinstance(text, str) else None
    except ValueError:
        return None


@dataclass
class CellsProvenance:
    """Per environment key and per identity item, how many finished cells had each value."""

    cells: int = 0
    environment: dict[str, Counter] = field(default_factory=dict)
    identity: dict[str, Counter] = field(default_factory=dict)
    kept: dict[str, Any] = field(default_factory=dict)  # the parent run's decisions to keep cells

    @classmethod
    def of(
        cls, cell_tags: Iterable[Mapping[str, str]], parent_tags: Mapping[str, str] | None = None
    ) -> CellsProvenance:
        found = cls()
        for tags in cell_tags:
            found.cells += 1
            env = _json(tags.get(TAG_ENVIRONMENT))
            if isinstance(env, dict):
                for key in ENVIRONMENT_KEYS:
                    if key in env:
                        found.environment.setdefault(key, Counter())[str(env[key])] += 1
            identity = _json(tags.get(TAG_IDENTITY))
            for item, value in identity.items() if isinstance(identity, dict) else ():
                if isinstance(value, list) and len(value) == 2:
                    found.identity.setdefault(str(item), Counter())[str(value[1])] += 1
        kept = _json((parent_tags or {}).get(TAG_KEPT))
        found.kept = kept if isinstance(kept, dict) else {}
        return found

    def differing(self) -> dict[str, Counter]:
        """The environment keys and identity items on which the cells differ."""
        out = {key: values for key, values in self.environment.items() if len(values) > 1}
        out.update({item: values for item, values in self.identity.items() if len(values) > 1})
        return out


def _counted(values: Counter) -> str:
    parts = [f"{value} ({n} cell{'s' if n != 1 else ''})" for value, n in values.most_common(MAX_VALUES)]
    if len(values) > MAX_VALUES:
        parts.append(f"{len(values) - MAX_VALUES} more")
    return "; ".join(parts)


def provenance_rows(found: CellsProvenance, manifest: Mapping[str, Any] | None) -> list[tuple[str, str]]:
    """The report's rows: the driver's environment, the cells' environment and identity (one
    value when they agree, each value with its cells where they differ), cells kept knowingly."""
    rows = []
    if manifest:
        torch = manifest.get("torch") or {}
        gpus = manifest.get("gpus") or []
        rows.append(
            (
                "environment of the driver",
                f"host {manifest.get('host')}, Python {manifest.get('python')}, torch {torch.get('version')}"
                + (f" (CUDA {torch['cuda']})" if torch.get("cuda") else "")
                + f", Ray {manifest.get('ray')}, MLflow {manifest.get('mlflow')}, "
                + (f"GPUs {', '.join(gpus)} (driver {manifest.get('driver')})" if gpus else "no GPU")
                + f"; {len(manifest.get('distributions') or {})} distributions in the parent run's "
                f"{ENVIRONMENT_ARTIFACT}",
            )
        )
    if found.environment:
        same = [f"{key} {next(iter(v))}" for key, v in found.environment.items() if len(v) == 1]
        if same:
            rows.append((f"environment of the cells ({found.cells})", ", ".join(same)))
    for item, values in sorted(found.identity.items()):
        if len(values) == 1:
            rows.append((f"{item} of the cells", next(iter(values))))
    for key, values in found.differing().items():
        rows.append((f"cells differ in {key}", _counted(values)))
    for decision in (found.kept.get("decisions") or [])[-MAX_VALUES:]:
        if isinstance(decision, dict):
            rows.append(
                (
                    "finished cells kept knowingly",
                    f"{decision.get('cells')} cells on {decision.get('when')} by {decision.get('user')} "
                    f"(--keep-finished): " + "; ".join(map(str, decision.get("changes") or [])),
                )
            )
    return rows


def read_manifest(client: Any, run_id: str | None) -> dict[str, Any] | None:
    """The parent run's environment manifest; None when it has none or it is not a small
    regular file holding a JSON object (the report goes on without it)."""
    import os
    import stat
    import tempfile

    from analysis.collect_store import quiet_downloads

    if run_id is None:
        return None
    try:
        with tempfile.TemporaryDirectory() as folder, quiet_downloads():
            path = client.download_artifacts(run_id, ENVIRONMENT_ARTIFACT, folder)
            info = os.lstat(path)
            if not stat.S_ISREG(info.st_mode) or info.st_size > MAX_MANIFEST_BYTES:
                return None
            with open(path, encoding="utf-8") as handle:
                data = json.loads(handle.read(MAX_MANIFEST_BYTES + 1))
    except Exception:  # noqa: BLE001 (a study run before manifests were written, a store that refuses)
        return None
    return data if isinstance(data, dict) else None
