"""Loading through a module's own ``load_weights`` (vLLM's convention): the loader traced per key into parameter
stand-ins, checked (coverage certificates, shapes), planned as region reads of exactly the elements each parameter
takes, and executed by the loader's executor; keys that do not trace are read whole and loaded for real."""

from .api import load_engine_weights, plan_engine_load

__all__ = ["load_engine_weights", "plan_engine_load"]
