"""Verify targets for issue 25 on trainers written elsewhere: trl 1.16, open_clip_train 3.3.0, Lightning 2.6.

- `sft_defaults`: trl's `SFTTrainer` with `SFTConfig`'s defaults (bf16 autocast on,
  even on CPU; activation checkpointing on) on a one-layer float32 Llama built
  from a config, with a word-level tokenizer built here (nothing downloaded).
  Right: it must pass at the tolerance its bf16 arithmetic implies.
- `sft_local_token_average`: the same with `average_tokens_across_devices=False`
  (bf16 off): each rank divides by its own token count and DDP averages the
  ranks' means. trl's collator pads each micro-batch to its own longest row, so
  verify must match rows by content to read the weights.
- `open_clip_accum_freq` / `open_clip_accum_freq_dropout`: open_clip_train's own
  `train_one_epoch` with its default flags (parsed by its own `parse_args`) but
  `--accum-freq K --precision fp32 --device cpu`, and open_clip's own `ClipLoss`,
  on two towers written here (with dropout in the second). open_clip's package
  `__init__` needs torchvision, which cannot load beside the CPU torch here, so
  `open_clip` is a stub module holding the names `open_clip_train.train` imports
  at module level (none of which `train_one_epoch` calls), and `ClipLoss` is
  loaded from the installed open_clip's loss.py; `train_one_epoch` runs as shipped.
- `lightning_ragged_mean` / `lightning_global_count`: a `lightning.Trainer` with its
  DDP strategy (`TrainerSpec`: it owns the sampler, the DDP wrap and the
  accumulation), a LightningModule whose loss is a mean over weighted rows:
  per micro-batch (a mean of means) and over the whole batch's weight (right).

Legend: W ranks, K micro-batches per rank.
"""

from __future__ import annotations

import importlib.util
import math
import sys
import types
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from wholebatch.verify.spec import TrainerRun, TrainerSpec, VerifySpec

ROWS, SEQ, VOCAB = 24, 10, 64
Batch = dict[str, Tensor]


# ---------------------------------------------------------------------------
# trl
# ---------------------------------------------------------------------------


def llama() -> nn.Module:
    """A one-layer Llama from a config, float32 (trl's defaults train it under bf16 autocast)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=SEQ,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip
    return LlamaForCausalLM(config)


def _tokenizer() -> Any:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {"[PAD]": 0, "[BOS]": 1, "[EOS]": 2, **{f"t{i}": i for i in range(3, VOCAB)}}
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="[PAD]")),
        pad_token="[PAD]", eos_token="[EOS]", bos_token="[BOS]",
    )  # fmt: skip


def lm_batch() -> Batch:
    """Right-padded rows of 2..SEQ tokens (ids >= 3), with attention_mask and labels."""
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(3, VOCAB, (ROWS, SEQ), generator=g)
    lengths = torch.randint(2, SEQ + 1, (ROWS,), generator=g)
    mask = (torch.arange(SEQ)[None, :] < lengths[:, None]).long()
    ids = ids * mask
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def lm_reference(model: nn.Module, batch: Batch) -> Tensor:
    """Mean next-token cross-entropy over every predicted token of the whole batch (float32)."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    targets = batch["labels"][:, 1:]
    ce = F.cross_entropy(
        logits[:, :-1].flatten(0, 1).float(), targets.flatten(), ignore_index=-100,
        reduction="sum",
    )  # fmt: skip
    return ce / (targets != -100).sum()


def _sft(run: TrainerRun, **config: Any) -> None:
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    batch = run.batch
    pairs_ = zip(batch["input_ids"], batch["attention_mask"], strict=True)
    rows = [ids[m.bool()].tolist() for ids, m in pairs_]
    args = SFTConfig(
        output_dir=run.output_dir, per_device_train_batch_size=run.per_device_rows,
        gradient_accumulation_steps=run.micro_batches, max_steps=1, max_grad_norm=0.0,
        use_cpu=True, report_to="none", save_strategy="no", logging_strategy="no",
        disable_tqdm=True, seed=run.seed, dataloader_drop_last=False, **config,
    )  # fmt: skip
    trainer = SFTTrainer(
        model=run.model, args=args, train_dataset=Dataset.from_dict({"input_ids": rows}),
        processing_class=_tokenizer(), optimizers=(run.optimizer, None),
    )  # fmt: skip
    trainer.train()


def sft_defaults() -> TrainerSpec:
    """trl SFTTrainer with SFTConfig's defaults: bf16 autocast, activation checkpointing."""
    return TrainerSpec(build_model=llama, batch=lm_batch(), train=_sft, reference_loss=lm_reference)


def sft_local_token_average() -> TrainerSpec:
    """MISTAKE: average_tokens_across_devices=False: each rank's own token mean, DDP-averaged."""
    return TrainerSpec(
        build_model=llama, batch=lm_batch(),
        train=lambda run: _sft(run, average_tokens_across_devices=False, bf16=False),
        reference_loss=lm_reference,
    )  # fmt: skip


# ---------------------------------------------------------------------------
# open_clip_train
# ---------------------------------------------------------------------------

D_IN, DIM = 6, 8


def _open_clip_loss() -> Any:
    stub = sys.modules.get("open_clip")
    spec = stub.__dict__["real_spec"] if stub is not None else importlib.util.find_spec("open_clip")
    assert spec is not None and spec.origin is not None, "open_clip is not installed"
    loaded = importlib.util.spec_from_file_location(
        "_open_clip_loss", Path(spec.origin).parent / "loss.py"
    )
    assert loaded is not None and loaded.loader is not None
    module = importlib.util.module_from_spec(loaded)
    loaded.loader.exec_module(module)
    return module


def _open_clip_train() -> Any:
    """open_clip_train.train, with `open_clip` a stub of the names it imports at module level."""
    if "open_clip" not in sys.modules:
        stub = types.ModuleType("open_clip")
        stub.real_spec = importlib.util.find_spec("open_clip")  # type: ignore[attr-defined]
        precision = {"bf16": torch.bfloat16, "pure_bf16": torch.bfloat16}
        precision |= {"fp16": torch.float16, "pure_fp16": torch.float16}
        stub.get_input_dtype = precision.get  # type: ignore[attr-defined]
        for name in ("CLIP", "CustomTextCLIP"):
            setattr(stub, name, type(name, (nn.Module,), {}))
        for name in ("get_tokenizer", "build_zero_shot_classifier"):
            setattr(stub, name, None)
        stub.IMAGENET_CLASSNAMES = stub.OPENAI_IMAGENET_TEMPLATES = ()  # type: ignore[attr-defined]
        sys.modules["open_clip"] = stub
    import open_clip_train.train

    return open_clip_train.train


class ClipTowers(nn.Module):
    """Two towers returning what open_clip's CLIP returns: features and logit_scale.exp()."""

    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()

        def tower() -> nn.Sequential:
            layers: list[nn.Module] = [nn.Linear(D_IN, DIM), nn.GELU()]
            layers += [nn.Dropout(dropout)] if dropout else []
            return nn.Sequential(*layers, nn.Linear(DIM, DIM))

        self.visual, self.text = tower(), tower()
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))
        self.double()

    def forward(self, image: Tensor, text: Tensor) -> dict[str, Tensor]:
        return {
            "image_features": F.normalize(self.visual(image), dim=-1),
            "text_features": F.normalize(self.text(text), dim=-1),
            "logit_scale": self.logit_scale.exp(),
        }


def pairs() -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(29)
    return (
        torch.randn(ROWS, D_IN, generator=g, dtype=torch.float64),
        torch.randn(ROWS, D_IN, generator=g, dtype=torch.float64),
    )


def clip_reference(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    out = model(*batch)
    logits = out["logit_scale"] * out["image_features"] @ out["text_features"].T
    labels = torch.arange(len(logits))
    return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2


class _Loader(list):  # type: ignore[type-arg]
    """What train_one_epoch reads of open_clip_train's DataInfo.dataloader."""

    num_batches = 0
    num_samples = 0


class _Data:
    def __init__(self, loader: _Loader) -> None:
        self.dataloader = loader

    def set_epoch(self, epoch: int) -> None:
        pass


def _train_one_epoch(
    model: nn.Module, optimizer: torch.optim.Optimizer, mbs: list[tuple[Tensor, Tensor]]
) -> None:
    clip_loss = _open_clip_loss()  # before the stub takes open_clip's name
    train = _open_clip_train()
    from open_clip_train.params import parse_args

    args = parse_args(["--accum-freq", str(len(mbs)), "--precision", "fp32", "--device", "cpu"])
    # what open_clip_train.main sets before training
    args.distributed, args.world_size = True, dist.get_world_size()
    args.rank = args.local_rank = dist.get_rank()
    args.distill, args.wandb, args.skip_scheduler = False, False, True
    args.batch_size = len(mbs[0][0])
    loss = clip_loss.ClipLoss(
        local_loss=args.local_loss, gather_with_grad=args.gather_with_grad, cache_labels=True,
        rank=args.rank, world_size=args.world_size, use_horovod=args.horovod,
    )  # fmt: skip
    loader = _Loader(mbs)
    loader.num_batches, loader.num_samples = len(mbs), sum(len(mb[0]) for mb in mbs)
    train.train_one_epoch(
        model, {"train": _Data(loader)}, loss, 0, optimizer, None, None, None, args
    )


def open_clip_accum_freq() -> VerifySpec:
    """MISTAKES (defaults + accum_freq=K): towers at 1/W (gather without grad), logit_scale at K."""
    return VerifySpec(
        build_model=ClipTowers, batch=pairs(), step=_train_one_epoch, reference_loss=clip_reference
    )


def open_clip_accum_freq_dropout() -> VerifySpec:
    """The same with dropout in the towers: the re-encoding also draws new masks."""
    return VerifySpec(
        build_model=lambda: ClipTowers(dropout=0.2), batch=pairs(), step=_train_one_epoch,
        reference_loss=clip_reference,
    )  # fmt: skip


# ---------------------------------------------------------------------------
# Lightning
# ---------------------------------------------------------------------------


def weighted_rows() -> tuple[Tensor, Tensor, Tensor]:
    g = torch.Generator().manual_seed(13)
    x = torch.randn(ROWS, D_IN, generator=g, dtype=torch.float64)
    y = torch.randn(ROWS, generator=g, dtype=torch.float64)
    return x, y, torch.randint(1, 7, (ROWS,), generator=g).double()  # items per row: ragged


def weighted_mean(model: nn.Module, batch: tuple[Tensor, Tensor, Tensor]) -> Tensor:
    x, y, w = batch
    return (w * (model(x) - y) ** 2).sum() / w.sum()


def _lightning_module(global_count: bool) -> nn.Module:
    import lightning as L

    class Regression(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(D_IN, 8), nn.Tanh(), nn.Linear(8, 1))
            self.double()
            self.optimizer: torch.optim.Optimizer | None = None
            self.total_items = 0.0

        def forward(self, x: Tensor) -> Tensor:
            return self.net(x).squeeze(-1)

        def training_step(self, batch: tuple[Tensor, Tensor, Tensor], batch_idx: int) -> Tensor:
            x, y, w = batch
            total = (w * (self(x) - y) ** 2).sum()
            if not global_count:
                return total / w.sum()  # this micro-batch's mean
            # Lightning divides by accumulate_grad_batches and DDP by W: undo both
            k, world = self.trainer.accumulate_grad_batches, self.trainer.world_size
            return total / self.total_items * k * world

        def configure_optimizers(self) -> torch.optim.Optimizer:
            assert self.optimizer is not None
            return self.optimizer

    return Regression()


def _lightning(run: TrainerRun) -> None:
    import lightning as L
    from torch.utils.data import DataLoader

    model: Any = run.model
    model.optimizer, model.total_items = run.optimizer, float(run.batch[2].sum())
    trainer = L.Trainer(
        accelerator="cpu", devices=run.world_size, strategy="ddp", max_steps=1,
        accumulate_grad_batches=run.micro_batches, limit_train_batches=run.micro_batches,
        logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=run.output_dir, num_sanity_val_steps=0,
    )  # fmt: skip
    trainer.fit(model, DataLoader(run.dataset, batch_size=run.per_device_rows))


def lightning_ragged_mean() -> TrainerSpec:
    """MISTAKE: each micro-batch's weighted mean; Lightning and DDP average the means."""
    return TrainerSpec(
        build_model=lambda: _lightning_module(global_count=False), batch=weighted_rows(),
        train=_lightning, reference_loss=weighted_mean, count_items=lambda b: b[2].sum(),
    )  # fmt: skip


def lightning_global_count() -> TrainerSpec:
    """Right: the weighted sum over the whole batch's weight, Lightning's 1/K and DDP's 1/W undone."""
    return TrainerSpec(
        build_model=lambda: _lightning_module(global_count=True), batch=weighted_rows(),
        train=_lightning, reference_loss=weighted_mean, count_items=lambda b: b[2].sum(),
    )  # fmt: skip
