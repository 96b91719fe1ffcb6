"""What an edit of a case is (reduce.py's one shrinker, its passes in shrink_model.py and shrink_world.py),
and the helpers every pass uses."""
from __future__ import annotations

import copy

Edit = tuple[str, "dict | None"]  # (what it does, the edited case's dict; None: it cannot be made)


def changed_copy(data: dict, **fields) -> dict:
    """A deep copy of a case's dict with ``fields`` set at its top level."""
    new = copy.deepcopy(data)
    new.update(fields)
    return new


def smaller_sizes(n: int, least: int = 1) -> list[int]:
    """The least value, then half: the smaller sizes an edit tries."""
    return sorted({v for v in (least, n // 2) if least <= v < n})
