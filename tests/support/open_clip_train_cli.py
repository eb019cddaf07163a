"""Run inside the open_clip_train venv (`make venv-oct`), by tests/e2e/test_open_clip_train_cli.py.

    python tests/support/open_clip_train_cli.py init DIR     # data, model config, initial weights
    python tests/support/open_clip_train_cli.py unfixed ARGS # open_clip_train's CLI, its own loop

`init` writes into DIR: `train.csv` and `img/*.png` (N random 32 x 32 images, each
with its own caption), `model/open_clip_config.json` (a tiny ViT CLIP: one block
per tower, width 32; open_clip's `local-dir:` schema, no weights), and the
initial weights as open_clip's factory builds them (seed 0), twice: `init.pt` for
one process and `init_ddp.pt` ("module." keys) for DDP ranks; every run starts
from them through `--resume`, so the initial parameters are known exactly.

`unfixed` runs `open_clip_train.main.main(ARGS)` with open_clip_train's own
`train_one_epoch`: only the CPU `device_ids` fix of wholebatch's launcher is
applied (without it open_clip_train's CLI cannot train on CPU ranks at all).
It is the mutation the exactness check must reject.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch

TINY_CLIP = {
    "embed_dim": 16,
    "vision_cfg": {"image_size": 32, "layers": 1, "width": 32, "head_width": 16, "patch_size": 16},
    "text_cfg": {"context_length": 16, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 1},
}
WORDS = ["red", "green", "blue", "cat", "dog", "tree", "car", "sky", "sea", "sun", "moon", "bird"]


def init(folder: Path, n: int, siglip: bool) -> None:
    import open_clip
    from PIL import Image

    (folder / "img").mkdir(parents=True, exist_ok=True)
    (folder / "model").mkdir(exist_ok=True)
    rng = np.random.default_rng(0)
    rows = ["filepath\ttitle"]
    for i in range(n):
        path = folder / "img" / f"{i}.png"
        pixels = rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(path)
        rows.append(f"{path}\ta {WORDS[i % 12]} {WORDS[(5 * i + 3) % 12]} {i}")
    (folder / "train.csv").write_text("\n".join(rows) + "\n")
    config = {"model_cfg": TINY_CLIP, "preprocess_cfg": {}}
    (folder / "model" / "open_clip_config.json").write_text(json.dumps(config))
    torch.manual_seed(0)
    extra = {"init_logit_scale": float(np.log(10)), "init_logit_bias": -10.0} if siglip else {}
    model = open_clip.create_model(f"local-dir:{folder / 'model'}", output_dict=True, **extra)
    state = model.state_dict()
    torch.save(state, folder / "init.pt")
    torch.save({f"module.{k}": v for k, v in state.items()}, folder / "init_ddp.pt")


def unfixed(argv: list[str]) -> None:
    import open_clip_train.main as cli

    from wholebatch.integrations.open_clip import _CpuDeviceIdsDDP

    torch.nn.parallel.DistributedDataParallel = _CpuDeviceIdsDDP  # type: ignore[misc]
    cli.main(argv[1:] if argv[:1] == ["--"] else argv)


if __name__ == "__main__":
    if sys.argv[1] == "init":
        init(Path(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "siglip")
    else:
        unfixed(sys.argv[2:])
