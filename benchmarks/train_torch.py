#!/usr/bin/env python3
"""PyTorch reference for the training-step benchmark.

Measures the time of one training step of a multilayer perceptron

    Linear(1024, 4096) -> ReLU -> Linear(4096, 4096) -> ReLU -> Linear(4096, 10)

in float32, with cross-entropy loss and plain SGD (lr 0.01, no momentum), on
random data drawn from a fixed seed. One step is zero_grad + forward + loss +
backward + optimizer step. Each figure is the median over the timed steps,
after some untimed warm-up steps.

Thread counts are set with torch.set_num_threads and, when torch's BLAS is
OpenBLAS (as in Debian's python3-torch), with openblas_set_num_threads too:
OpenBLAS keeps its own thread pool, sized to all CPUs, which
torch.set_num_threads does not touch.

Configurations:
  * single process, 1 thread, then 2 threads, batch B;
  * DistributedDataParallel, gloo backend, 2 processes on this machine, each
    with 1 thread:
      - strong scaling: global batch B, i.e. B/2 per process;
      - weak scaling:   B per process, global batch 2B.
    Steps are timed on rank 0 only (no barrier before a step; the gradient
    all_reduce inside backward keeps the ranks in step), and the ranks
    synchronise once at the end.

If torch.distributed or gloo is not usable here, a line says so and why, and
the single-process figures are still printed.

Run:
    python3 benchmarks/train_torch.py
    python3 benchmarks/train_torch.py --steps 5 --warmup 2 --mode single

Options: --steps N (timed steps, default 10), --warmup N (default 3),
--batch B (global batch, default 256), --mode {all,single,ddp} (default all).
"""

import argparse
import ctypes
import datetime
import os
import socket
import statistics
import sys
import time

import torch
import torch.nn as nn

IN_FEATURES = 1024
HIDDEN = 4096
CLASSES = 10
LR = 0.01
SEED = 1234


def _openblas_libs():
    """The OpenBLAS libraries loaded in this process (usually one)."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "openblas" in line.lower()}
    except OSError:
        return []
    libs, seen = [], set()
    for path in sorted(paths):
        try:
            lib = ctypes.CDLL(path)
            addr = ctypes.cast(lib.openblas_set_num_threads, ctypes.c_void_p).value
            lib.openblas_get_num_threads
        except (OSError, AttributeError):
            continue
        if addr not in seen:  # libblas.so.3 wrappers resolve to libopenblas's
            seen.add(addr)
            libs.append(lib)
    return libs


def set_threads(n):
    """torch intra-op threads and, where it is OpenBLAS, BLAS threads."""
    torch.set_num_threads(n)
    for lib in _openblas_libs():
        lib.openblas_set_num_threads(n)


def blas_threads():
    libs = _openblas_libs()
    if not libs:
        return "no OpenBLAS"
    return "OpenBLAS threads %s" % "/".join(str(l.openblas_get_num_threads()) for l in libs)


def make_model():
    return nn.Sequential(
        nn.Linear(IN_FEATURES, HIDDEN),
        nn.ReLU(),
        nn.Linear(HIDDEN, HIDDEN),
        nn.ReLU(),
        nn.Linear(HIDDEN, CLASSES),
    )


def make_data(batch, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, IN_FEATURES, generator=g, dtype=torch.float32)
    y = torch.randint(0, CLASSES, (batch,), generator=g)
    return x, y


def train_step(model, opt, loss_fn, x, y):
    opt.zero_grad(set_to_none=True)
    loss = loss_fn(model(x), y)
    loss.backward()
    opt.step()
    return loss


def time_steps(model, opt, x, y, steps, warmup):
    """Median seconds per training step over `steps` timed steps."""
    loss_fn = nn.CrossEntropyLoss()
    for _ in range(warmup):
        train_step(model, opt, loss_fn, x, y)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        train_step(model, opt, loss_fn, x, y)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def fmt(seconds, samples):
    return "step %.1f ms  (%.0f samples/s)" % (seconds * 1e3, samples / seconds)


# --------------------------------------------------------------------------
# Single process
# --------------------------------------------------------------------------

def run_single(threads, batch, steps, warmup):
    set_threads(threads)
    torch.manual_seed(SEED)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    x, y = make_data(batch, SEED + 1)
    t = time_steps(model, opt, x, y, steps, warmup)
    label = "thread " if threads == 1 else "threads"
    print("torch single %d %s batch %d: %s" % (threads, label, batch, fmt(t, batch)),
          flush=True)


# --------------------------------------------------------------------------
# DDP, gloo, 2 processes
# --------------------------------------------------------------------------

def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ddp_worker(rank, world, port, per_proc_batch, steps, warmup, results):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    set_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    try:
        torch.manual_seed(SEED)  # same initial weights; DDP broadcasts rank 0's anyway
        model = DDP(make_model())
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        x, y = make_data(per_proc_batch, SEED + 1 + rank)  # each rank its own shard
        t = time_steps(model, opt, x, y, steps, warmup)
        dist.barrier()
        if rank == 0:
            results.put(t)
    finally:
        dist.destroy_process_group()


def run_ddp_config(per_proc_batch, steps, warmup, world=2):
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    mp.spawn(ddp_worker,
             args=(world, free_port(), per_proc_batch, steps, warmup, results),
             nprocs=world, join=True)
    return results.get()


def ddp_unavailable_reason():
    try:
        import torch.distributed as dist
    except Exception as e:  # pragma: no cover
        return "cannot import torch.distributed (%s)" % e
    if not dist.is_available():
        return "torch.distributed is not available in this build"
    if not dist.is_gloo_available():
        return "this torch build has no gloo backend"
    return None


def run_ddp(batch, steps, warmup):
    world = 2
    reason = ddp_unavailable_reason()
    if reason is not None:
        print("torch ddp gloo: unavailable: %s" % reason, flush=True)
        return
    if batch % world:
        print("torch ddp gloo: skipped: batch %d is not divisible by %d processes"
              % (batch, world), flush=True)
        return
    configs = [
        ("strong (global %d)" % batch, batch // world, batch),
        ("weak (%d per proc, global %d)" % (batch, batch * world), batch, batch * world),
    ]
    for name, per_proc, global_batch in configs:
        try:
            t = run_ddp_config(per_proc, steps, warmup, world)
        except Exception as e:
            # A worker's failure arrives as its whole traceback; its last line
            # is the error itself.
            lines = [l.strip() for l in str(e).splitlines() if l.strip()]
            print("torch ddp gloo: unavailable: %s"
                  % (lines[-1] if lines else type(e).__name__), flush=True)
            return
        print("torch ddp gloo %d procs %s: %s" % (world, name, fmt(t, global_batch)),
              flush=True)


# --------------------------------------------------------------------------

def parallel_backend():
    for line in torch.__config__.parallel_info().splitlines():
        if line.startswith("ATen parallel backend"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=10, help="timed steps (default 10)")
    p.add_argument("--warmup", type=int, default=3, help="warm-up steps (default 3)")
    p.add_argument("--batch", type=int, default=256, help="global batch (default 256)")
    p.add_argument("--mode", choices=["all", "single", "ddp"], default="all")
    a = p.parse_args()
    if a.steps < 1 or a.warmup < 0 or a.batch < 1:
        p.error("need --steps >= 1, --warmup >= 0, --batch >= 1")

    print("torch %s, python %s" % (torch.__version__, sys.version.split()[0]))
    print("threads by default: %d intra-op, %d inter-op, %s; parallel backend %s; "
          "%d CPUs; OMP_NUM_THREADS=%s, OPENBLAS_NUM_THREADS=%s"
          % (torch.get_num_threads(), torch.get_num_interop_threads(),
             blas_threads(), parallel_backend(), os.cpu_count() or 0,
             os.environ.get("OMP_NUM_THREADS", "unset"),
             os.environ.get("OPENBLAS_NUM_THREADS", "unset")))
    print("MLP %d-%d-%d-%d float32, cross-entropy, SGD lr %g; median of %d steps "
          "after %d warm-up" % (IN_FEATURES, HIDDEN, HIDDEN, CLASSES, LR,
                                a.steps, a.warmup), flush=True)

    if a.mode in ("all", "single"):
        for threads in (1, 2):
            run_single(threads, a.batch, a.steps, a.warmup)
    if a.mode in ("all", "ddp"):
        run_ddp(a.batch, a.steps, a.warmup)


if __name__ == "__main__":
    main()
