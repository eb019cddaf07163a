# Correct accumulation and AMP: nothing here may be flagged.
import contextlib

import torch
import torch.distributed as dist
import torch.nn.functional as F

import wholebatch


def nanogpt_style(model, get_batch, optimizer, gradient_accumulation_steps):
    # Fixed-size token blocks, no padding: every micro-batch holds the same item count,
    # so dividing the mean by the number of steps is exact.
    for _ in range(1000):
        for _micro_step in range(gradient_accumulation_steps):
            x, y = get_batch("train")
            logits, loss = model(x, y)
            loss = loss / gradient_accumulation_steps
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def global_token_count(model, micro_batches, optimizer):
    # DESIGN.md rule 3: sum of item losses / global item count, agreed before backward.
    n_items = sum(int((y != -100).sum()) for _, y in micro_batches)
    n = torch.tensor(float(n_items))
    dist.all_reduce(n)
    for x, y in micro_batches:
        loss_sum = F.cross_entropy(model(x), y, ignore_index=-100, reduction="sum")
        (loss_sum / n).backward()
    optimizer.step()
    optimizer.zero_grad()


def sum_loss_over_accum(model, loader, optimizer, accum):
    for i, (x, y) in enumerate(loader):
        loss = F.cross_entropy(model(x), y, ignore_index=-100, reduction="sum")
        (loss / accum).backward()
        if (i + 1) % accum == 0:
            optimizer.step()
            optimizer.zero_grad()


def no_sync_right(model, micro_batches, optimizer):
    n = len(micro_batches)
    for i, (x, y) in enumerate(micro_batches):
        if i < n - 1:
            with model.no_sync():
                loss = model(x).sum() / n
                loss.backward()
        else:
            loss = model(x).sum() / n
            loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def no_sync_inline(model, micro_batches, optimizer):
    for x in micro_batches[:-1]:
        with model.no_sync():
            model(x).sum().backward()
    model(micro_batches[-1]).sum().backward()
    optimizer.step()
    optimizer.zero_grad()


def no_sync_contextlib(model, micro_batches, optimizer, loss_fn):
    for i, batch in enumerate(micro_batches):
        last = i == len(micro_batches) - 1
        with contextlib.nullcontext() if last else model.no_sync():
            loss = loss_fn(model, batch)
            loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def amp_right(model, loader, optimizer, scaler):
    for x, y in loader:
        optimizer.zero_grad()
        with torch.autocast("cuda"):
            loss = F.mse_loss(model(x), y)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()


def amp_optional_clip(model, loader, optimizer, scaler, max_norm):
    for x, y in loader:
        scaler.scale(F.mse_loss(model(x), y)).backward()
        if max_norm:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()


def no_amp_clip(model, loader, optimizer):
    for x, y in loader:
        F.mse_loss(model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()


def amp_or_not(model, loader, optimizer, scaler, use_amp):
    for x, y in loader:
        loss = F.mse_loss(model(x), y)
        if not use_amp:
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
        else:
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
        optimizer.zero_grad()


def per_sample_grads(model, batch, optimizer):
    # Zeroing every sample is right here: each sample's gradient is read, then combined.
    per_sample = []
    for x, y in batch:
        model.zero_grad()
        F.mse_loss(model(x), y).backward()
        per_sample.append([p.grad.clone() for p in model.parameters()])
    for p, gs in zip(model.parameters(), zip(*per_sample, strict=True), strict=True):
        p.grad = torch.stack(gs).mean(0)
    optimizer.step()


def zero_on_step(model, loader, optimizer, accum):
    for i, (x, y) in enumerate(loader):
        F.mse_loss(model(x), y, reduction="sum").backward()
        if (i + 1) % accum == 0:
            optimizer.step()
            optimizer.zero_grad()


def wholebatch_accumulate(model, optimizer, loader, loss_fn):
    acc = wholebatch.Accumulator(model, optimizer)
    for micro_batches in loader:
        acc.step(micro_batches, loss_fn)
