"""A Lightning `ClusterEnvironment` for ranks that already joined their gloo group.

The harness worlds (tests/support/harness.py) and verify's ranks initialise
torch.distributed before Lightning starts; this environment tells Lightning to
use that group as it is instead of launching or rendezvousing.
"""

from __future__ import annotations

from typing import Any

import torch


def existing_group_environment() -> Any:
    """The environment class (Lightning is imported here, on first use)."""
    from lightning.fabric.plugins.environments import ClusterEnvironment

    class ExistingGroup(ClusterEnvironment):  # the ranks already joined their group
        creates_processes_externally = True  # type: ignore[assignment]
        main_address = "127.0.0.1"  # type: ignore[assignment]
        main_port = 0  # type: ignore[assignment]

        @staticmethod
        def detect() -> bool:
            return True

        def world_size(self) -> int:
            return torch.distributed.get_world_size()

        def set_world_size(self, size: int) -> None:
            pass

        def global_rank(self) -> int:
            return torch.distributed.get_rank()

        def set_global_rank(self, rank: int) -> None:
            pass

        def local_rank(self) -> int:
            return torch.distributed.get_rank()

        def node_rank(self) -> int:
            return 0

    return ExistingGroup
