"""Charts for `make bench`: reads target/bench/results.json, writes PNGs next to it.

throughput.png  req/s by path, each against its floor
latency.png     p50 / p90 / p99 / p99.9 by path
followers.png   how long after the leader each coalesced follower got its answer
"""
import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

out = Path(sys.argv[1] if len(sys.argv) > 1 else "target/bench")
results = json.loads((out / "results.json").read_text())
rows = results["rows"]
names = [r["name"] for r in rows]

fig, ax = plt.subplots(figsize=(10, 5))
colors = ["#999999" if ("floor" in n or "baseline" in n) else "#2b7bba" for n in names]
ax.barh(names, [r["rps"] for r in rows], color=colors)
ax.invert_yaxis()
ax.set_xlabel("requests per second (grey: baselines and floors)")
ax.set_title("holysheep-edge: throughput by path, same run")
fig.tight_layout()
fig.savefig(out / "throughput.png", dpi=110)

fig, ax = plt.subplots(figsize=(10, 5))
width = 0.2
for i, (key, label) in enumerate([("p50_us", "p50"), ("p90_us", "p90"), ("p99_us", "p99"), ("p999_us", "p99.9")]):
    ax.barh([y + i * width for y in range(len(rows))], [r[key] / 1000 for r in rows], height=width, label=label)
ax.set_yticks([y + 1.5 * width for y in range(len(rows))], names)
ax.invert_yaxis()
ax.set_xscale("log")
ax.set_xlabel("latency (ms, log scale)")
ax.legend()
ax.set_title("holysheep-edge: latency percentiles by path")
fig.tight_layout()
fig.savefig(out / "latency.png", dpi=110)

fig, ax = plt.subplots(figsize=(10, 4))
for s in results["series"]:
    d = sorted(s["delays_us"])
    if d:
        ax.plot([x / 1000 for x in d], [100 * (i + 1) / len(d) for i in range(len(d))], label=s["name"])
ax.set_xscale("symlog", linthresh=1)
ax.set_xlabel("delay after the leader's answer (ms)")
ax.set_ylabel("% of followers")
ax.legend()
ax.set_title("coalesced followers: delay after the leader")
fig.tight_layout()
fig.savefig(out / "followers.png", dpi=110)
print(f"written: {out}/throughput.png, latency.png, followers.png")
