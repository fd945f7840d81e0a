"""The two-batch noise-scale estimator against least squares, where B_simple is known.

x ~ N(0, I_d), y = w* . x + noise (std sigma), loss 0.5 (w . x - y)^2, evaluated at
w = w* + delta: the per-example gradient has mean G = delta and covariance
Sigma = (|delta|^2 + sigma^2) I + delta delta^T, so
B_simple = (d (|delta|^2 + sigma^2) + |delta|^2) / |delta|^2.

Prints, per seed, the estimate after N steps (small batches of 8, big batch of 32, EMA
0.995), the true value and the relative error; with ``--adam`` the Adam-preconditioned
estimate against its own closed form (weights 1 / (sqrt(v_hat) + eps) frozen after 50 steps).

Run: ``python experiments/gns_least_squares.py [--seeds 10] [--steps 800] [--adam]``.
"""

from __future__ import annotations

import argparse
import sys

import torch
from torch import nn

from paratune._table import format_table
from paratune.profiler.gns import GradientNoiseScale, adam_preconditioners, micro_batch_gradients


def run(seed: int, *, dim: int, sigma: float, steps: int, adam: bool) -> dict[str, float]:
    gen = torch.Generator().manual_seed(seed)
    w_star = torch.randn(dim, generator=gen, dtype=torch.float64)
    delta = torch.randn(dim, generator=gen, dtype=torch.float64)
    delta = delta / delta.norm() * 0.8
    model = nn.Linear(dim, 1, bias=False).double()
    with torch.no_grad():
        model.weight.copy_((w_star + delta)[None])

    def backward(size: int) -> None:
        x = torch.randn(size, dim, generator=gen, dtype=torch.float64)
        y = x @ w_star + sigma * torch.randn(size, generator=gen, dtype=torch.float64)
        (0.5 * ((model(x).squeeze(-1) - y) ** 2).mean()).backward()

    weights, w = None, torch.ones(dim, dtype=torch.float64)
    if adam:
        opt = torch.optim.Adam(model.parameters(), lr=0.0)
        for _ in range(50):
            opt.zero_grad()
            backward(32)
            opt.step()
        weights = adam_preconditioners([opt])
        w = weights[model.weight].flatten()
    gns = GradientNoiseScale(beta=0.995)
    for _ in range(steps):
        small, big = micro_batch_gradients(list(model.parameters()),
                                           [lambda: backward(8)] * 4, preconditioners=weights)
        est = gns.update(small, big, 8, 32)
    truth = float((w * ((delta.norm() ** 2 + sigma**2) + delta**2)).sum()
                  / (w * delta**2).sum())
    return {"seed": seed, "estimate": est.b_simple, "true": truth,
            "rel_error": est.b_simple / truth - 1}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--steps", type=int, default=800)
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--sigma", type=float, default=1.0)
    parser.add_argument("--adam", action="store_true")
    args = parser.parse_args(argv)
    rows = [run(s, dim=args.dim, sigma=args.sigma, steps=args.steps, adam=args.adam)
            for s in range(args.seeds)]
    print(format_table(rows, title="B_simple: two-batch estimate vs closed form"
                       + (" (Adam-preconditioned)" if args.adam else "")))
    errors = [abs(r["rel_error"]) for r in rows]
    print(f"max |relative error| {max(errors):.3f}, mean {sum(errors) / len(errors):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
