"""Integrations: one module per peer library, wholebatch's guarantee behind the peer's signatures.

    wholebatch.integrations.open_clip    ClipLoss, SigLipLoss (open_clip 3.3.0's signatures),
                                         train_one_epoch and the CLI (open_clip_train 3.3.0's)
    wholebatch.integrations.lightly      NTXentLoss (lightly 1.6.0's), memory bank included
    wholebatch.integrations.huggingface  WholeBatchTrainer / WholeBatchTrainerMixin (transformers 5.23)
    wholebatch.integrations.lightning    WholeBatchAccumulation, a Lightning 2.6.6 callback
    wholebatch.integrations.trl          WholeBatchSFTTrainer, WholeBatchDPOTrainer, WholeBatchGRPOTrainer (trl 1.16)
    wholebatch.integrations.deepspeed    DeepSpeedAccumulator (a DeepSpeed 0.19.8 ZeRO-1/2 engine)

Each module imports its peer only inside itself, and only where the code needs
it (none of them needs it to import), and uses only wholebatch's public
layers (`wholebatch.comm`, `wholebatch.losses`, `wholebatch.train`). Nothing
is imported here: `import wholebatch.integrations.open_clip` loads that one.
See docs/integrations/.
"""

from __future__ import annotations

__all__: list[str] = []
