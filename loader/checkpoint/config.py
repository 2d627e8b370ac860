"""The checkpoint's ``config.json``, read as untrusted input: only what loading needs from it (the
``quantization_config``), never executed, bounded in size.
"""

from __future__ import annotations

import os

from .untrusted import err, read_json_file

CONFIG_NAME = "config.json"
#: a config larger than this is refused before it is read (real ones are a few KiB)
MAX_CONFIG_BYTES = 4 << 20


def quantization_config(root: str) -> dict | None:
    """The ``quantization_config`` object of ``root/config.json``; None when there is no config or no such entry.

    Args:
        root: the checkpoint folder.

    Raises:
        CheckpointError: the config is not a regular file, over :data:`MAX_CONFIG_BYTES`, not valid JSON, not
            an object, or its ``quantization_config`` is not an object (naming the file).
    """
    path = os.path.join(root, CONFIG_NAME)
    if not os.path.lexists(path):
        return None
    config = read_json_file(path, MAX_CONFIG_BYTES, "config")
    if not isinstance(config, dict):
        raise err(path, f"config must be a JSON object, got {type(config).__name__}")
    quant = config.get("quantization_config")
    if quant is not None and not isinstance(quant, dict):
        raise err(path, f"quantization_config must be an object, got {type(quant).__name__}")
    return quant
