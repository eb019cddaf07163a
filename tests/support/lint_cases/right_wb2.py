# Correct optimisation loops: nothing here may be flagged.
import torch
import torch.distributed as dist

import wholebatch


def plain(model, loader, optimizer, criterion):
    for x, y in loader:
        optimizer.zero_grad()
        loss = criterion(model(x), y)
        loss.backward()
        optimizer.step()


def zero_after_step(model, loader, optimizer, criterion):
    for x, y in loader:
        loss = criterion(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def accumulate(model, loader, optimizer, criterion, accum_steps):
    optimizer.zero_grad()
    for i, (x, y) in enumerate(loader):
        loss = criterion(model(x), y) / accum_steps
        loss.backward()
        if (i + 1) % accum_steps == 0:
            optimizer.step()
            optimizer.zero_grad()


def accumulate_inner(model, loader, optimizer, criterion):
    for batch in loader:
        optimizer.zero_grad()
        for x, y in batch:
            criterion(model(x), y).backward()
        optimizer.step()


def grads_set_to_none(model, loader, opt, criterion):
    for x, y in loader:
        loss = criterion(model(x), y)
        loss.backward()
        opt.step()
        for p in model.parameters():
            p.grad = None


def helper_zeroes(model, loader, optimizer, criterion):
    for x, y in loader:
        loss = criterion(model(x), y)
        loss.backward()
        optimizer_step(optimizer)


def optimizer_step(optimizer):
    optimizer.step()
    optimizer.zero_grad()


def lbfgs(model, loader, optimizer, criterion):
    for x, y in loader:

        def closure():
            optimizer.zero_grad()
            loss = criterion(model(x), y)
            loss.backward()
            return loss

        optimizer.step(closure)


def gan(netD, netG, optD, optG, loader, criterion):
    for real in loader:
        optD.zero_grad()
        errD = criterion(netD(real), 1)
        errD.backward()
        optD.step()
        optG.zero_grad()
        errG = criterion(netD(netG(real)), 1)
        errG.backward()
        optG.step()


def skip_bad_step(model, loader, optimizer, criterion):
    for x, y in loader:
        loss = criterion(model(x), y)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if not torch.isfinite(norm):
            optimizer.zero_grad()
            continue
        optimizer.step()
        optimizer.zero_grad()


def skip_bad_step_else(model, loader, optimizer, criterion):
    for x, y in loader:
        optimizer.zero_grad()
        loss = criterion(model(x), y)
        loss.backward()
        if torch.isfinite(loss):
            optimizer.step()
        else:
            optimizer.zero_grad()


def step_elsewhere(model, loader, optimizer, train_step):
    for batch in loader:
        loss = train_step(model, batch)  # runs backward
        optimizer.step()
        optimizer.zero_grad()


def optimizer_step_only(self_optimizer, scheduler):
    self_optimizer.step()
    self_optimizer.zero_grad()
    scheduler.step()


def grads_by_autograd(model, loader, optimizer, criterion):
    params = list(model.parameters())
    for x, y in loader:
        loss = criterion(model(x), y)
        grads = torch.autograd.grad(loss, params)
        for p, g in zip(params, grads, strict=True):
            p.grad = g
        optimizer.step()


def wholebatch_accumulator(model, optimizer, loader, loss_fn):
    acc = wholebatch.Accumulator(model, optimizer)
    for micro_batches in loader:
        stats = acc.step(micro_batches, loss_fn)
        print(stats)


def wholebatch_cached(model, optimizer, loader, loss_fn):
    cached = wholebatch.CachedStep(model, optimizer, loss_fn)
    for mbs in loader:
        cached.step(mbs)


def scheduler_loop(scheduler, epochs):
    for _ in range(epochs):
        scheduler.step()


def manual_sgd_no_grad(model, loader, criterion, lr):
    for x, y in loader:
        model.zero_grad()
        criterion(model(x), y).backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= lr * p.grad


@torch.no_grad()
def sgd_update(params, lr):
    for p in params:
        p.add_(p.grad, alpha=-lr)


def ema_update(ema, model, decay):
    with torch.no_grad():
        for e, p in zip(ema.parameters(), model.parameters(), strict=True):
            e.data.mul_(decay).add_(p.data, alpha=1 - decay)


def clip_grads_data(model, c):
    for p in model.parameters():
        p.grad.data.mul_(c)


def weight_decay_grad(model, wd):
    for p in model.parameters():
        p.grad.add_(p, alpha=wd)


class MySGD(torch.optim.Optimizer):
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                d_p = p.grad.data
                p.data.add_(d_p, alpha=-group["lr"])


def fgsm_detached(model, x, y, eps, criterion):
    x = x.clone().requires_grad_(True)
    criterion(model(x), y).backward()
    x_adv = (x + eps * x.grad.sign()).detach()
    return x_adv


def ddp_all_reduce_grads(model, world_size):
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= world_size


def manual_sgd_data_graph_rebuilt(model, loader, criterion, lr):
    # Through .data, but after the backward and before the next forward: no saved graph
    # sees the change, so the result equals a no_grad update (not WB205).
    for x, y in loader:
        model.zero_grad()
        criterion(model(x), y).backward()
        for p in model.parameters():
            p.data -= lr * p.grad


def manual_sgd_data_method(params, lr):
    for p in params:
        d_p = p.grad
        p.data.add_(d_p, alpha=-lr)
