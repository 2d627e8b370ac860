"""Rules: which checkpoint keys feed which model tensors, through which conversion.

:mod:`.conversion` (the vocabulary: ``Rename``, ``Convert``, ``Conversion`` and its ``MetaRun``) ← :mod:`.hf`
(transformers' ``WeightRenaming``/``WeightConverter`` adapters) ← :mod:`.matching` (rules applied to keys) ←
:mod:`.grouping` (keys gathered per model tensor), :mod:`.tied` (tied weights) ← :mod:`.keys` (``plan_keys``:
transformers-exact key mapping, into a :mod:`.keyplan` ``KeyPlan``).
"""

from .conversion import Conversion, Convert, MetaRun, Rename, dot_natural_key
from .keyplan import KeyPlan
from .keys import plan_keys

__all__ = ["Conversion", "Convert", "KeyPlan", "MetaRun", "Rename", "dot_natural_key", "plan_keys"]
