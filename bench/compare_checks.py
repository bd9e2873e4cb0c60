"""Compare benchmark rows of the checks-on and checks-off builds (bench/device_checks.sh: <folder>/on<round>.json,
off<round>.json): per case, the best median over the rounds of each build, and on / off. Prints the table (worst case last) and writes JSON."""

from __future__ import annotations

import argparse
import glob
import json
import os


def rows(folder: str, variant: str) -> tuple[dict, dict]:
    best, meta = {}, {}
    for path in sorted(glob.glob(os.path.join(folder, f"{variant}[0-9]*.json"))):
        with open(path) as f:
            doc = json.load(f)
        meta = {k: doc[k] for k in ("commit", "gpu", "torch", "triton", "cuda", "ceilings")}
        for r in doc["rows"]:
            key = (r["bench"], r["shape"], r["provider"])
            if r["us"] > 0:
                best[key] = min(best.get(key, float("inf")), r["us"])
    return best, meta


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("folder")
    p.add_argument("--json")
    p.add_argument("--limit", type=float, default=1.02, help="the largest on / off ratio allowed")
    a = p.parse_args()
    on, meta = rows(a.folder, "on")
    off, _ = rows(a.folder, "off")
    keys = sorted(set(on) & set(off), key=lambda k: on[k] / off[k])
    out = []
    print(f"{'bench':<16} {'shape':<30} {'provider':<14} {'on us':>9} {'off us':>9} {'on/off':>7}")
    for k in keys:
        ratio = on[k] / off[k]
        out.append(dict(bench=k[0], shape=k[1], provider=k[2], on_us=on[k], off_us=off[k], ratio=ratio))
        print(f"{k[0]:<16} {k[1]:<30} {k[2]:<14} {on[k]:>9.2f} {off[k]:>9.2f} {ratio:>7.3f}")
    worst = max((r["ratio"] for r in out), default=float("nan"))
    over = [r for r in out if r["ratio"] > a.limit]
    print(f"{len(out)} cases; worst on/off {worst:.3f}; {len(over)} above {a.limit}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(meta, limit=a.limit, worst=worst, rows=out), f, indent=1)


if __name__ == "__main__":
    main()
