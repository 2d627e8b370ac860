"""Rules: which checkpoint keys feed which model tensors, through which conversion.

:mod:`.conversion` (the vocabulary: ``Rename``, ``Convert``, ``Conversion``) ← :mod:`.hf` (transformers'
``WeightRenaming``/``WeightConverter`` adapters) ← :mod:`.keys` (``plan_keys``: transformers-exact key mapping).
"""

from .conversion import Conversion, Convert, Rename, dot_natural_key
from .keys import KeyPlan, plan_keys

__all__ = ["Conversion", "Convert", "KeyPlan", "Rename", "dot_natural_key", "plan_keys"]
