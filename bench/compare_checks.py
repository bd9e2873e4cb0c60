"""Compare benchmark rows of the checks-on and checks-off builds (bench/device_checks.sh: <folder>/on<round>.json,
off<round>.json): per case, the best median over the rounds of each build, and on / off. Prints the table (worst
case last) and writes JSON.

Also per case: `spread`, the larger of the two builds' round-to-round range (slowest round / fastest round - 1)
of the same case. An on / off above the limit by less than the case's own spread between rounds of one build is
marked `~`: that difference is within what re-running the same build gives, not yet a measured cost (more rounds
tell)."""

from __future__ import annotations

import argparse
import glob
import json
import os


def rows(folder: str, variant: str) -> tuple[dict, dict]:
    """(case -> [us of each round], metadata) of one build."""
    runs, meta = {}, {}
    for path in sorted(glob.glob(os.path.join(folder, f"{variant}[0-9]*.json"))):
        with open(path) as f:
            doc = json.load(f)
        meta = {k: doc[k] for k in ("commit", "gpu", "torch", "triton", "cuda", "ceilings")}
        for r in doc["rows"]:
            if r["us"] > 0:
                runs.setdefault((r["bench"], r["shape"], r["provider"]), []).append(r["us"])
    return runs, meta


def spread(us: list[float]) -> float:
    return max(us) / min(us) - 1.0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("folder")
    p.add_argument("--json")
    p.add_argument("--limit", type=float, default=1.02, help="the largest on / off ratio allowed")
    a = p.parse_args()
    on, meta = rows(a.folder, "on")
    off, _ = rows(a.folder, "off")
    keys = sorted(set(on) & set(off), key=lambda k: min(on[k]) / min(off[k]))
    out = []
    print(f"{'bench':<16} {'shape':<30} {'provider':<14} {'on us':>9} {'off us':>9} {'on/off':>7} {'spread':>7}")
    for k in keys:
        best_on, best_off = min(on[k]), min(off[k])
        ratio, sp = best_on / best_off, max(spread(on[k]), spread(off[k]))
        noise = ratio > a.limit and ratio - 1.0 <= sp
        out.append(dict(bench=k[0], shape=k[1], provider=k[2], on_us=best_on, off_us=best_off, ratio=ratio,
                        spread=sp, on_rounds=on[k], off_rounds=off[k], within_spread=noise))
        print(f"{k[0]:<16} {k[1]:<30} {k[2]:<14} {best_on:>9.2f} {best_off:>9.2f} {ratio:>7.3f} {sp:>7.3f}"
              + (" ~" if noise else ""))
    worst = max((r["ratio"] for r in out), default=float("nan"))
    over = [r for r in out if r["ratio"] > a.limit]
    rounds = min((len(r["on_rounds"]) for r in out), default=0), min((len(r["off_rounds"]) for r in out), default=0)
    print(f"{len(out)} cases (at least {rounds[0]} rounds on, {rounds[1]} off); worst on/off {worst:.3f}; "
          f"{len(over)} above {a.limit}, {sum(r['within_spread'] for r in over)} of them within their spread (~)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(meta, limit=a.limit, worst=worst, rows=out), f, indent=1)


if __name__ == "__main__":
    main()
