"""Compares pdo with PyTorch: runs tests/torch_reference.cpp's program (the path is the first
argument), rebuilds every input from its output, computes the same in PyTorch (float64) and
checks pdo's float32 results against it. Exits 1 naming each result that differs.

    python3 tests/torch_reference.py build/tests/torch_reference
"""
import subprocess
import sys

import numpy as np
import torch
import torch.nn.functional as F

TOLERANCE = 2e-5  # |pdo - torch| / (1 + |torch|), pdo in float32

out = subprocess.run([sys.argv[1]], check=True, capture_output=True, text=True).stdout
pdo = {}
for line in out.splitlines():
    fields = line.split()
    rank = int(fields[1])
    shape = tuple(int(v) for v in fields[2:2 + rank])
    pdo[fields[0]] = np.array([float(v) for v in fields[2 + rank:]], dtype=np.float64).reshape(shape)

failures = []
checked = 0


def t(name, grad=False):
    """pdo's input `name` as a float64 torch tensor."""
    return torch.tensor(pdo[name], dtype=torch.float64, requires_grad=grad)


def check(name, expected):
    """pdo's result `name` against PyTorch's."""
    global checked
    expected = expected.detach().numpy() if torch.is_tensor(expected) else np.asarray(expected, dtype=np.float64)
    got = pdo[name]
    checked += 1
    if got.shape != expected.shape:
        failures.append(f"{name}: shape {got.shape}, PyTorch {expected.shape}")
        return
    error = float(np.max(np.abs(got - expected) / (1 + np.abs(expected)))) if expected.size else 0.0
    if not error <= TOLERANCE:
        failures.append(f"{name}: relative error {error:.2e}\n  pdo     {got.ravel()[:8]}\n  PyTorch {expected.ravel()[:8]}")


unary = {
    "exp": torch.exp, "log": torch.log, "sqrt": torch.sqrt, "tanh": torch.tanh, "sigmoid": torch.sigmoid, "relu": torch.relu,
    "gelu": F.gelu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "softmax1": lambda x: torch.softmax(x, 1), "softmax0": lambda x: torch.softmax(x, 0),
    "log_softmax1": lambda x: torch.log_softmax(x, 1), "log_softmax0": lambda x: torch.log_softmax(x, 0),
    "layer_norm": lambda x: F.layer_norm(x, (x.shape[-1],)),
    "sum0": lambda x: x.sum(0), "mean1": lambda x: x.mean(1),
    "max1": lambda x: x.amax(1), "max0": lambda x: x.amax(0),  # ties share the gradient, as amax's
    "transpose": lambda x: x.t(), "reciprocal": lambda x: 1 / (x + 3), "square": lambda x: x * x - x,
    "reshape": lambda x: x.reshape(5, 3), "where": lambda x: torch.where(x > 0, x * 2, x * x),
}
for name, f in unary.items():
    x = t(name + "_x", True)
    y = f(x)
    check(name + "_y", y)
    (y * t(name + "_w")).sum().backward()
    check(name + "_gx", x.grad)

a, b = t("binary_a", True), t("binary_b", True)
y = torch.maximum(a, b) * 2 + torch.minimum(a, b) - a / (b + 3)
check("binary_y", y)
(y * t("binary_w")).sum().backward()
check("binary_ga", a.grad)
check("binary_gb", b.grad)

for p in ("mm", "bmm", "bcast_mm"):
    a, b = t(p + "_a", True), t(p + "_b", True)
    y = torch.matmul(a, b)
    check(p + "_y", y)
    (y * t(p + "_w")).sum().backward()
    check(p + "_ga", a.grad)
    check(p + "_gb", b.grad)

logits = t("ce_logits", True)
loss = F.cross_entropy(logits, torch.tensor([0, 3, 1, 2, 3]))
check("ce_y", loss.reshape(pdo["ce_y"].shape))
loss.backward()
check("ce_g", logits.grad)

a, b = t("mse_a", True), t("mse_b", True)
loss = F.mse_loss(a, b)
check("mse_y", loss.reshape(pdo["mse_y"].shape))
loss.backward()
check("mse_ga", a.grad)
check("mse_gb", b.grad)

for cfg, (stride, padding) in enumerate([(1, 0), (2, 1), (1, 1)]):
    p = f"conv{cfg}_"
    x, w, bias = t(p + "x", True), t(p + "weight", True), t(p + "bias", True)
    y = F.conv2d(x, w, bias, stride=stride, padding=padding)
    check(p + "y", y)
    (y * t(p + "w")).sum().backward()
    check(p + "gx", x.grad)
    check(p + "gweight", w.grad)
    check(p + "gbias", bias.grad)

for cfg, (kernel, stride, padding) in enumerate([(2, 2, 0), (2, 1, 0), (3, 3, 1)]):
    for kind in ("maxpool", "avgpool"):
        p = f"{kind}{cfg}_"
        x = t(p + "x", True)
        pool = F.max_pool2d if kind == "maxpool" else F.avg_pool2d  # avg counts the padding, as PyTorch's default
        y = pool(x, kernel, stride, padding)
        check(p + "y", y)
        (y * t(p + "w")).sum().backward()
        check(p + "gx", x.grad)

optimizers = [
    lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01),
    lambda ps: torch.optim.Adam(ps, lr=0.05),
    lambda ps: torch.optim.AdamW(ps, lr=0.05, weight_decay=0.1),
    lambda ps: torch.optim.Adam(ps, lr=0.05, weight_decay=0.1),
    lambda ps: torch.optim.SGD(ps, lr=0.2),
]
for o, make in enumerate(optimizers):
    layer = torch.nn.Linear(4, 3).double()
    with torch.no_grad():
        layer.weight.copy_(t("opt_w0").t())  # pdo's weight is [in, out], PyTorch's [out, in]
        layer.bias.copy_(t("opt_b0"))
    opt = make(layer.parameters())
    norms = []
    for step in range(4):
        opt.zero_grad()
        F.mse_loss(layer(t("opt_x")), t("opt_t")).backward()
        if o == 4:
            norms.append(float(torch.nn.utils.clip_grad_norm_(layer.parameters(), 0.05)))
        opt.step()
    if o == 4:
        check("opt4_norms", norms)
    check(f"opt{o}_w", layer.weight.t())
    check(f"opt{o}_b", layer.bias)

opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
schedule = torch.optim.lr_scheduler.StepLR(opt, 3, 0.5)
rates = []
for step in range(12):
    rates.append(opt.param_groups[0]["lr"])
    opt.step()
    schedule.step()
check("step_lr", rates)


def mlp():
    """The MLP of torch_reference.cpp with pdo's initial parameters."""
    layers = [torch.nn.Linear(6, 8), torch.nn.GELU(), torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 6), torch.nn.ReLU(),
              torch.nn.Linear(6, 4)]
    model = torch.nn.Sequential(*layers).double()
    with torch.no_grad():
        for i in (0, 2, 4, 6):
            model[i].weight.copy_(t(f"mlp_init_{i}.weight").t())
            model[i].bias.copy_(t(f"mlp_init_{i}.bias"))
    return model


x, labels = t("mlp_x"), torch.tensor(pdo["mlp_y"], dtype=torch.long)


def train(model, opt, steps=5):
    """The losses of `steps` steps of one process over the whole batch."""
    losses = []
    for step in range(steps):
        opt.zero_grad()
        loss = F.cross_entropy(model(x), labels)
        loss.backward()
        opt.step()
        losses.append(float(loss))
    return losses


model = mlp()  # data parallel
check("dp_losses", train(model, torch.optim.Adam(model.parameters(), lr=0.01)))
for i in (0, 2, 4, 6):
    check(f"dp_{i}.weight", model[i].weight.t())
    check(f"dp_{i}.bias", model[i].bias)
model = mlp()  # tensor parallel
check("tp_losses", train(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)))

print(f"torch_reference: {checked} results of pdo against PyTorch {torch.__version__}, relative tolerance {TOLERANCE}")
for f in failures:
    print("DIFFERS", f)
sys.exit(1 if failures else 0)
