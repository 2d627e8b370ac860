"""Distributed loading: agreement of outcomes (:mod:`.session`), broadcast of replicated regions
(:mod:`.broadcast`), and the distributed load that composes them with planning and execution (:mod:`.load`)."""

from .load import load_distributed, read_together
from .session import DEFAULT_TIMEOUT, LoadSession, peer_errors, timeout_seconds

__all__ = ["DEFAULT_TIMEOUT", "LoadSession", "load_distributed", "peer_errors", "read_together", "timeout_seconds"]
