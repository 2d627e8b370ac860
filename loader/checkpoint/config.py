"""The checkpoint's ``config.json``, read as untrusted input: only what loading needs from it (the
``quantization_config``), never executed, bounded in size.
"""

from __future__ import annotations

from ..storage import Store
from ..storage.untrusted import err, loads_json

CONFIG_NAME = "config.json"
#: a config larger than this is refused before it is read (real ones are a few KiB)
MAX_CONFIG_BYTES = 4 << 20


def config_location(store: Store) -> str:
    """Where the checkpoint's ``config.json`` is."""
    return store.locate(CONFIG_NAME)


def quantization_config(store: Store) -> dict | None:
    """The ``quantization_config`` object of the folder's ``config.json``; None when there is no config or no such
    entry.

    Args:
        store: the checkpoint folder's store.

    Raises:
        CheckpointError: the config is not a regular file, over :data:`MAX_CONFIG_BYTES`, not valid JSON, not
            an object, or its ``quantization_config`` is not an object (naming the file).
    """
    path = config_location(store)
    if not store.exists(path):
        return None
    config = loads_json(path, store.read_small(path, MAX_CONFIG_BYTES, "config"), "config")
    if not isinstance(config, dict):
        raise err(path, f"config must be a JSON object, got {type(config).__name__}")
    quant = config.get("quantization_config")
    if quant is not None and not isinstance(quant, dict):
        raise err(path, f"quantization_config must be an object, got {type(quant).__name__}")
    return quant
