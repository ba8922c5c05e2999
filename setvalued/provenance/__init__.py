"""What a trial ran, as digests: the training core's code, the plugins it names, the data it
reads (`studies` records them with every cell and refuses to reuse a cell whose differ).

- `file_digests`: the SHA-256 of files, cached by path, size and times (`DigestCache`);
- `code`: the ``setvalued`` package and plugin distributions (`setvalued_fingerprint`,
  `plugin_fingerprint`);
- `data`: a data config's files or parameters (`data_fingerprint`).

Pure Python (no torch): a built-in loader is imported only to list a data set's files.
"""

from setvalued.provenance.code import CodeFingerprint, plugin_fingerprint, setvalued_fingerprint
from setvalued.provenance.data import FILE_DATASETS, DataFingerprint, data_files, data_fingerprint, data_key
from setvalued.provenance.file_digests import (
    CACHE_ENV,
    DigestCache,
    DigestProgress,
    cache_path,
    combined_digest,
    file_digest,
    python_digest,
)

__all__ = [
    "CodeFingerprint",
    "plugin_fingerprint",
    "setvalued_fingerprint",
    "FILE_DATASETS",
    "DataFingerprint",
    "data_fingerprint",
    "data_files",
    "data_key",
    "CACHE_ENV",
    "DigestCache",
    "DigestProgress",
    "cache_path",
    "combined_digest",
    "file_digest",
    "python_digest",
]
