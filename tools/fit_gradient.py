"""Which contributions reached a DeepSpeed step: fit the gradient it applied against each micro-step's gradient.

    python tools/fit_gradient.py SCENARIO.json [--step N] [--previous] [--rows] [--with MECHANISM,...]

Runs the scenario once on the installed DeepSpeed at world size 1, in this process (the scenario must use the
client SGD optimizer, the default: its update over -lr is the gradient the step applied), and for each trained
parameter solves, by least squares, DeepSpeed's applied gradient at train step N as a combination of the
PyTorch reference's per-micro-step gradients (each micro-step's backwards averaged: two backwards of one forward
give equal gradients).  Coefficients 2, 2, 1 read "all but the boundary micro-step's second backward"; 0, 0, 1
"that backward alone".  ``--rows``: the same per row of each 2-d parameter the whole-parameter fit leaves a
residual on (a partial loss: a bucket's tail, an embedding's rows).  ``--previous``: fit against the step before's
contributions (a replayed stale gradient).  ``--with``: the reference's contributions with these counterfactual
mechanisms applied (an output-hooks division, say).  Only when DeepSpeed and PyTorch differ at some step (the
executor computes references only then); nothing is printed otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np


def _fit(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, float]:
    coef, *_ = np.linalg.lstsq(x, y, rcond=None)
    return coef, float(np.linalg.norm(x @ coef - y) / (np.linalg.norm(y) + 1e-12))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("scenario")
    ap.add_argument("--step", type=int, default=0)
    ap.add_argument("--previous", action="store_true")
    ap.add_argument("--rows", action="store_true")
    ap.add_argument("--with", dest="with_", default="")
    args = ap.parse_args(argv)
    for k, v in (("DS_ACCELERATOR", "cpu"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29541"), ("RANK", "0"),
                 ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        os.environ.setdefault(k, v)
    import zerostate.harness.executor as ex
    import zerostate.harness.net.counterfactual as cf
    from zerostate.harness.net.config import LR
    from zerostate.model.scenario import Optimizer, Scenario

    with open(args.scenario) as fh:
        sc = Scenario.from_dict(json.load(fh))
    if sc.optimizer is not Optimizer.SGD or sc.world_size != 1:
        print("fit_gradient: needs the client SGD optimizer at world size 1 (the update is then -lr x the gradient)",
              file=sys.stderr)
        return 2
    captured: list[tuple[int, list[Any]]] = []

    def capture(cs: Sequence[Any], micros: int) -> None:
        captured.append((micros, list(cs)))  # each step's contributions; the reference left as it is
        return None

    cf.MECHANISMS["capture"] = cf.Mechanism("capture", lambda _sc: True, keep=capture)
    wanted = tuple(filter(None, args.with_.split(",")))

    def fit(sc_: Scenario, rec: Any, pt: Any, ds: Any) -> tuple[()]:
        ex._against(sc_, rec, ("capture", *wanted), pt, ds)
        step = args.step - 1 if args.previous else args.step
        _, cs = captured[step]
        print(f"train step {args.step}, fitted against step {step}'s contributions:",
              [(c.kind, c.micro, c.index) for c in cs])
        before = rec.start if args.step == 0 else rec.seen[args.step - 1]
        before, after = before[1] or before[0], rec.seen[args.step][1] or rec.seen[args.step][0]
        for n in sorted(after):
            if n not in before:
                continue
            g = (-(after[n].double() - before[n].double()) / LR).numpy()
            _report(n, g, cs, args.rows)
        return ()

    ex.counterfactual_runs = fit  # type: ignore[assignment]
    ex.execute(sc)
    return 0


def _report(name: str, g: np.ndarray, cs: Sequence[Any], rows: bool) -> None:
    keys = sorted({(c.kind, c.micro) for c in cs if name in c.grads})
    if not keys:
        print(f"{name}: no contribution, |applied| {np.linalg.norm(g):.3g}")
        return
    per = []
    for k in keys:
        parts = [c.grads[name].double().numpy() for c in cs if (c.kind, c.micro) == k and name in c.grads]
        per.append(sum(parts) / len(parts))
    coef, res = _fit(np.stack([p.reshape(-1) for p in per], 1), g.reshape(-1))
    print(f"{name}: |applied| {np.linalg.norm(g):.3g} per {keys}: {np.round(coef, 4).tolist()} residual {res:.2g}")
    if rows and g.ndim == 2 and res > 1e-2:
        for r in range(g.shape[0]):
            x = np.stack([p[r] for p in per], 1)
            if np.linalg.norm(g[r]) < 1e-12 and np.linalg.norm(x) < 1e-12:
                continue
            c, rr = _fit(x, g[r])
            print(f"   row {r}: {np.round(c, 3).tolist()} residual {rr:.2g}")


if __name__ == "__main__":
    raise SystemExit(main())
