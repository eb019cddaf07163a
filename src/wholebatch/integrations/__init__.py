"""Integrations: one module per peer library, wholebatch's guarantee behind the peer's signatures.

    wholebatch.integrations.open_clip    ClipLoss, SigLipLoss (open_clip 3.3.0's signatures)
    wholebatch.integrations.lightly      NTXentLoss (lightly 1.6.0's), memory bank included
    wholebatch.integrations.huggingface  WholeBatchTrainer / WholeBatchTrainerMixin (transformers 5.23)

Each module imports its peer only inside itself, and only where the code needs
it (none of them needs it to import), and uses only wholebatch's public
layers (`wholebatch.comm`, `wholebatch.losses`, `wholebatch.train`). Nothing
is imported here: `import wholebatch.integrations.open_clip` loads that one.
See docs/integrations/.
"""

from __future__ import annotations

__all__: list[str] = []
