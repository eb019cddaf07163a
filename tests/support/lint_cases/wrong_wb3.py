# Accumulation and AMP mistakes: each flagged line ends with `# expect: CODE`.
import torch
import torch.nn.functional as F
from torch.nn.utils import clip_grad_norm_


def hf_style(model, loader, optimizer, args):
    for step, batch in enumerate(loader):
        outputs = model(**batch)
        loss = outputs.loss
        loss = loss / args.gradient_accumulation_steps  # expect: WB301
        loss.backward()
        if (step + 1) % args.gradient_accumulation_steps == 0:
            optimizer.step()
            optimizer.zero_grad()


def token_loss(model, loader, optimizer, k):
    for i, (x, y) in enumerate(loader):
        logits = model(x)
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=-100)
        loss /= k  # expect: WB301
        loss.backward()
        if (i + 1) % k == 0:
            optimizer.step()
            optimizer.zero_grad()


def masked_mean(model, micro_batches, optimizer):
    for x, y, mask in micro_batches:
        per_tok = (model(x) - y) ** 2
        loss = (per_tok * mask).sum() / mask.sum()
        (loss / len(micro_batches)).backward()  # expect: WB301
    optimizer.step()
    optimizer.zero_grad()


def no_sync_backward_only(model, micro_batches, optimizer):
    for i, (x, y) in enumerate(micro_batches):
        loss = F.mse_loss(model(x), y, reduction="sum")
        if i < len(micro_batches) - 1:
            with model.no_sync():  # expect: WB302
                loss.backward()
        else:
            loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def clip_before_unscale(model, loader, optimizer, scaler):
    for x, y in loader:
        with torch.autocast("cuda"):
            loss = F.mse_loss(model(x), y)
        scaler.scale(loss).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # expect: WB303
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()


def unscale_after_clip(model, loader, optimizer, scaler):
    for x, y in loader:
        scaler.scale(F.mse_loss(model(x), y)).backward()
        clip_grad_norm_(model.parameters(), 1.0)  # expect: WB303
        scaler.unscale_(optimizer)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()


def zero_every_micro_batch(model, loader, optimizer, accum):
    for i, (x, y) in enumerate(loader):
        optimizer.zero_grad()  # expect: WB304
        loss = F.mse_loss(model(x), y, reduction="sum")
        loss.backward()
        if (i + 1) % accum == 0:
            optimizer.step()


def zero_every_inner(model, loader, optimizer):
    for batch in loader:
        for x, y in batch:
            optimizer.zero_grad()  # expect: WB304
            F.mse_loss(model(x), y).backward()
        optimizer.step()
