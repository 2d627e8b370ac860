"""Tied weights: one tensor object known under several model names, and transformers' tied pairs."""

from __future__ import annotations

from collections.abc import Mapping

from .conversion import Conversion


def resolve_tied(state, produced, hf_pairs: Mapping[str, str]) -> tuple[dict[str, str], list[Conversion]]:
    """Group names of one tensor object (and transformers' tied pairs); choose a canonical name per group:
    a loaded one (transformers' tie source first), else the tie source, else the first name."""
    if _untied(state, hf_pairs):
        return {}, []  # every name alone: nothing to group (the usual case, without a record per name)
    parent: dict[str, str] = {}

    def find(n: str) -> str:
        while parent.get(n, n) != n:
            n = parent[n]
        return n

    def union(a: str, b: str) -> None:
        ra, rb = find(a), find(b)
        if ra != rb:
            parent[rb] = ra

    first_by_id: dict[int, str] = {}
    for name, tensor in state.items():
        if tensor is None:
            continue
        union(first_by_id.setdefault(id(tensor), name), name)
    preferred = set()
    for alias, source in hf_pairs.items():
        if alias in state and source in state:
            union(source, alias)
            preferred.add(source)
    members: dict[str, list[str]] = {}
    for name in state:
        members.setdefault(find(name), []).append(name)

    tied: dict[str, str] = {}
    duplicates: list[Conversion] = []
    for names in members.values():
        if len(names) < 2:
            continue
        loaded = sorted((n for n in names if n in produced), key=lambda n: n not in preferred)
        if loaded:
            canonical = loaded[0]
        else:
            canonical = next((n for n in names if n in preferred), names[0])
        for other in loaded[1:]:
            conv = produced[other]
            if len(conv.targets) != 1:
                raise ValueError(
                    f"model tensors {canonical!r} and {other!r} are one tensor but are loaded by different "
                    f"conversions ({produced[canonical].sources} and {conv.sources})"
                )
            duplicates.append(conv)
        tied.update({n: canonical for n in names if n != canonical})
    return tied, duplicates


def _untied(state, hf_pairs: Mapping[str, str]) -> bool:
    """Whether no two names of ``state`` are one tensor object and no tied pair joins two of its names."""
    tensors = [t for t in state.values() if t is not None]
    if len(set(map(id, tensors))) != len(tensors):
        return False
    return not any(a != s and a in state and s in state for a, s in hf_pairs.items())
