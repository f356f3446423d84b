"""One finding of ``stubcache doctor`` (its own checks and the fleet tier's)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass
class Check:
    """One finding: ``status`` is ``ok``, ``warn`` or ``error``; ``fix`` says what to do."""

    name: str
    status: str
    detail: str
    fix: str = ""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)
