"""Training tenant for ``bench/gpu/swap.py``: a small PyTorch transformer, every loss to the bit.

A real framework job among the rotated tenants: a 4-layer transformer (random init,
fixed seeds) learns to output each position's predecessor in a fixed random sequence,
with AdamW under bf16 autocast, deterministic (``torch.use_deterministic_algorithms``,
``CUBLAS_WORKSPACE_CONFIG=:4096:8``, data drawn once on the GPU from a seeded
generator). Every ``--cycle`` steps it starts again from its initial weights, a fresh
optimiser and the first batch, so step ``i`` of any run must give exactly the loss of
step ``i mod cycle`` of an unswapped run, wherever the swaps fell. It also holds a
patterned ballast of ``--gib`` GiB (``swap_worker.GpuTenant``), checked after every
stall, so that it is as large as the other tenants and is swapped like them.

Its log is ``swap_worker.py``'s (``alloc``, ``p``, ``verify``, ``oom``, ``error``) plus:

* ``model NAME KEY=VALUE ... cycle=K``: what it trains;
* ``loss STEP T HEX ;``: step ``STEP`` (from 0) ended at ``T`` (CLOCK_MONOTONIC) with
  the loss ``float.fromhex(HEX)``; the ``;`` tells a whole line from one cut short.

The protocol with the bench is ``swap_worker.py``'s (``i``, ``a`` on the pipe from
``$KIWI_BENCH_GO_FD``). With ``KIWI_BENCH_REFERENCE=1`` it is the unswapped
reference instead: no pipe, no ballast, one cycle, then ``done STEPS``. The switch
is an environment variable so that both have the same command line.

Without torch, or with ``--dry-run``, it trains a tiny pure-Python linear regression
with SGD (busy for ~5 ms a step, as the simulated GPU counts CPU time), clearly
labelled ``model pure-python ...`` (FALLBACK): the plumbing and the comparison run,
not PyTorch.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from typing import Any

from swap_worker import (
    GpuTenant,
    HostTenant,
    Log,
    add_bench_args,
    allocate,
    parse_bench_args,
    run_loop,
    verify,
)
from worker import _die_with_parent, _say, _wait_for

CUBLAS_WORKSPACE = ":4096:8"


class TinyRegression:
    """The fallback: a linear regression on fixed data, SGD, in pure Python."""

    name = "pure-python linear-regression dim=8 samples=64 batch=8 sgd lr=0.05 (FALLBACK: no torch)"

    def __init__(self, seed: int, busy_s: float = 0.005) -> None:
        rng = random.Random(seed)
        self.dim, self.batch, self.lr, self.busy_s = 8, 8, 0.05, busy_s
        truth = [rng.uniform(-1.0, 1.0) for _ in range(self.dim)]
        self.xs = [[rng.gauss(0.0, 1.0) for _ in range(self.dim)] for _ in range(64)]
        self.ys = [sum(w * x for w, x in zip(truth, row, strict=True)) for row in self.xs]
        self.ys = [y + rng.gauss(0.0, 0.1) for y in self.ys]
        self.reset()

    def reset(self) -> None:
        self.w = [0.0] * self.dim
        self.b = 0.0

    def step(self, i: int) -> float:
        end = time.monotonic() + self.busy_s
        rows = [(i * self.batch + k) % len(self.xs) for k in range(self.batch)]
        grad_w, grad_b, loss = [0.0] * self.dim, 0.0, 0.0
        for r in rows:
            x = self.xs[r]
            err = sum(w * v for w, v in zip(self.w, x, strict=True)) + self.b - self.ys[r]
            loss += err * err
            grad_b += 2.0 * err
            grad_w = [g + 2.0 * err * v for g, v in zip(grad_w, x, strict=True)]
        n = float(len(rows))
        self.w = [w - self.lr * g / n for w, g in zip(self.w, grad_w, strict=True)]
        self.b -= self.lr * grad_b / n
        while time.monotonic() < end:  # busy: the simulated GPU counts CPU time as activity
            pass
        return loss / n


class TorchTrainer:
    """A small decoder-style transformer; plain matmul attention (no fused kernels)."""

    def __init__(self, torch: Any, seed: int, device: str = "cuda") -> None:
        self.torch = torch
        nn, f = torch.nn, torch.nn.functional
        self.dev = torch.device(device, 0) if device == "cuda" else torch.device(device)
        self.cuda = device == "cuda"
        torch.use_deterministic_algorithms(True)
        det = getattr(getattr(torch, "utils", None), "deterministic", None)
        if det is not None and hasattr(det, "fill_uninitialized_memory"):
            # Deterministic mode also fills every torch.empty (47.5 GiB of ballast, each
            # autograd buffer) with NaN; nothing here reads memory it did not write.
            det.fill_uninitialized_memory = False
        torch.backends.cudnn.benchmark = False
        torch.backends.cuda.matmul.allow_tf32 = False
        layers, d, heads, seq, batch, feat, batches = 4, 256, 4, 128, 16, 32, 16
        self.name = (
            f"torch-transformer layers={layers} d_model={d} heads={heads} seq={seq} "
            f"batch={batch} bf16-autocast AdamW deterministic torch={torch.__version__}"
        )

        class Block(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
                self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
                self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

            def forward(self, x: Any, mask: Any) -> Any:
                b, t, _ = x.shape
                qkv = self.qkv(self.ln1(x)).view(b, t, 3, heads, d // heads)
                q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
                att = (q @ k.transpose(-2, -1)) * (d // heads) ** -0.5
                att = att.masked_fill(mask, float("-inf")).softmax(dim=-1)
                x = x + self.proj((att @ v).transpose(1, 2).reshape(b, t, d))
                return x + self.fc2(f.gelu(self.fc1(self.ln2(x))))

        class Model(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.inp, self.out = nn.Linear(feat, d), nn.Linear(d, feat)
                self.pos = nn.Parameter(torch.randn(seq, d) * 0.02)
                self.blocks = nn.ModuleList(Block() for _ in range(layers))
                self.ln = nn.LayerNorm(d)

            def forward(self, x: Any, mask: Any) -> Any:
                h = self.inp(x) + self.pos
                for block in self.blocks:
                    h = block(h, mask)
                return self.out(self.ln(h))

        torch.manual_seed(seed)  # the weights: drawn on the CPU, then moved
        self.model = Model().to(self.dev)
        self.init = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        gen = torch.Generator(device=self.dev)
        gen.manual_seed(seed + 1)  # the data: drawn once, on the GPU
        self.x = torch.randn(batches, batch, seq, feat, device=self.dev, generator=gen)
        self.y = torch.zeros_like(self.x)
        self.y[:, :, 1:] = self.x[:, :, :-1]  # each position's predecessor
        ones = torch.ones(seq, seq, dtype=torch.bool, device=self.dev)
        self.mask = torch.triu(ones, diagonal=1)
        self.loss_fn = f.mse_loss
        self.opt: Any = None
        self.reset()

    def reset(self) -> None:
        self.model.load_state_dict(self.init)
        self.opt = self.torch.optim.AdamW(self.model.parameters(), lr=1e-3, weight_decay=0.01)

    def step(self, i: int) -> float:
        torch = self.torch
        k = i % self.x.shape[0]
        self.opt.zero_grad(set_to_none=True)
        with torch.autocast(device_type=self.dev.type, dtype=torch.bfloat16):
            pred = self.model(self.x[k], self.mask)
        loss = self.loss_fn(pred.float(), self.y[k])
        loss.backward()
        self.opt.step()
        return float(loss.item())  # a sync: the step is done on the GPU


class Trainer:
    """Steps, cycles and the loss lines around a model."""

    def __init__(self, model: TinyRegression | TorchTrainer, cycle: int, log: Log) -> None:
        self.model, self.cycle, self.log = model, cycle, log
        self.steps = 0

    def step(self) -> None:
        i = self.steps % self.cycle
        if i == 0 and self.steps:
            self.model.reset()  # a new cycle: the initial weights and a fresh optimiser
        loss = self.model.step(i)
        self.log.line(f"loss {self.steps} {time.monotonic():.6f} {loss.hex()} ;")
        self.steps += 1


def main() -> int:
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)  # before CUDA starts
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    add_bench_args(parser)
    parser.add_argument("--seed", type=int, default=0, help="ballast pattern seed")
    parser.add_argument("--train-seed", type=int, default=1234, help="weights and data seed")
    parser.add_argument("--cycle", type=int, default=200, help="steps, then start again")
    parser.add_argument("--dry-run", action="store_true", help="the pure-Python fallback")
    parser.add_argument("--device", default="cuda", help="torch device (cpu: to try the code)")
    reference = os.environ.get("KIWI_BENCH_REFERENCE") == "1"
    args = parse_bench_args(parser, need_go=not reference)
    if args.parent:
        _die_with_parent(args.parent)
    torch: Any = None
    if not args.dry_run:
        try:
            import torch  # noqa: PLC0415 - after the PDEATHSIG, and never in a dry run
        except ImportError:
            torch = None
    if reference:
        return _reference(torch, args)

    _say("imported")
    _wait_for(args.go_fd, b"i")
    model, tenant, oom = _build(torch, args)
    if model is None:
        return 4
    _say(f"ready 0 {model.name.split()[0]}")
    _wait_for(args.go_fd, b"a")
    gap_s = args.gap_ms / 1e3
    with open(args.out, "w", buffering=1) as out:
        log = Log(out)
        log.line(f"model {model.name} cycle={args.cycle}")
        try:
            size = allocate(tenant, log, args.alloc_timeout, oom)
        except oom:
            log.line(f"error {time.monotonic():.6f} out of memory for {args.alloc_timeout:g} s")
            _say("error out of memory")
            return 5
        _say(f"allocated {size}")
        verify(tenant, log, gap_s, oom)
        trainer = Trainer(model, args.cycle, log)
        count = run_loop(
            trainer.step,
            lambda: verify(tenant, log, gap_s, oom),
            args.seconds,
            log,
            args.every_ms / 1e3,
            gap_s,
        )
    _say(f"done {count}")
    return 0


def _build(torch: Any, args: argparse.Namespace) -> tuple[Any, Any, type]:
    """(model, ballast holder, out-of-memory error); model None if CUDA is missing."""
    if torch is None:
        return TinyRegression(args.train_seed), HostTenant(args.dry_mib, args.seed), MemoryError
    if args.device == "cuda" and not torch.cuda.is_available():
        print("train_worker: torch sees no CUDA device", file=sys.stderr, flush=True)
        return None, None, MemoryError
    tenant = GpuTenant(torch, args.gib, args.seed, 256, args.device)  # tiny operands
    model = TorchTrainer(torch, args.train_seed, args.device)
    return model, tenant, torch.cuda.OutOfMemoryError


def _reference(torch: Any, args: argparse.Namespace) -> int:
    """One cycle alone, ungated, no ballast: the losses every rotated cycle must equal."""
    if torch is None:
        model: TinyRegression | TorchTrainer = TinyRegression(args.train_seed)
    elif args.device == "cuda" and not torch.cuda.is_available():
        print("train_worker: torch sees no CUDA device", file=sys.stderr, flush=True)
        return 4
    else:
        model = TorchTrainer(torch, args.train_seed, args.device)
    with open(args.out, "w", buffering=1) as out:
        log = Log(out)
        log.line(f"model {model.name} cycle={args.cycle}")
        trainer = Trainer(model, args.cycle, log)
        t0 = time.monotonic()
        while trainer.steps < args.cycle:
            trainer.step()
        log.progress(time.monotonic(), trainer.steps)
    _say(f"done {trainer.steps} in {time.monotonic() - t0:.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
