# Optimisation-loop mistakes: each flagged line ends with `# expect: CODE`.
import torch


def never_zeroed(model, loader, optimizer, criterion):
    model.train()
    for x, y in loader:
        loss = criterion(model(x), y)
        loss.backward()
        optimizer.step()  # expect: WB201


def never_zeroed_outer(model, loader, opt, criterion, epochs):
    for _ in range(epochs):
        opt.zero_grad()  # once per epoch only
        for x, y in loader:
            loss = criterion(model(x), y)
            loss.backward()
            opt.step()  # expect: WB201


def never_zeroed_amp(model, loader, optimizer, scaler, criterion):
    for x, y in loader:
        with torch.autocast("cuda"):
            loss = criterion(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)  # expect: WB201
        scaler.update()


def zero_between(model, loader, optimizer, criterion):
    for x, y in loader:
        loss = criterion(model(x), y)
        loss.backward()
        optimizer.zero_grad()  # expect: WB202
        optimizer.step()


def zero_between_model(model, loader, sgd, criterion):
    for x, y in loader:
        loss = criterion(model(x), y)
        loss.backward()
        model.zero_grad()  # expect: WB202
        sgd.step()


def no_backward(model, loader, optimizer, criterion):
    for x, y in loader:
        optimizer.zero_grad()
        loss = criterion(model(x), y)
        optimizer.step()  # expect: WB203


def manual_sgd(model, loader, criterion, lr):
    for x, y in loader:
        model.zero_grad()
        loss = criterion(model(x), y)
        loss.backward()
        for p in model.parameters():
            p -= lr * p.grad  # expect: WB204


def manual_sgd_inplace(w, b, x, y, lr):
    loss = ((x @ w + b - y) ** 2).mean()
    loss.backward()
    w.sub_(lr * w.grad)  # expect: WB204
    b.add_(b.grad, alpha=-lr)  # expect: WB204


def manual_sgd_data_before_backward(model, x, y, criterion, lr):
    # The graph of `out` saved the old weights; the second backward runs through it.
    out = model(x)
    criterion(out, y).backward(retain_graph=True)
    for p in model.parameters():
        p.data -= lr * p.grad  # expect: WB205
    criterion(out, y).backward()


def manual_sgd_data_method(model, params, x, lr):
    feats = model(x)
    for p in params:
        d_p = p.grad
        p.data.add_(d_p, alpha=-lr)  # expect: WB205
    feats.sum().backward()
