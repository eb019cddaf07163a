"""Integrations: one module per peer library, wholebatch's guarantee behind the peer's signatures.

Each module imports its peer only inside itself, and uses only wholebatch's
public layers (`wholebatch.comm`, `wholebatch.losses`, `wholebatch.train`).
"""

from __future__ import annotations

__all__: list[str] = []
