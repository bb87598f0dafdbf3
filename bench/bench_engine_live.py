"""The correlator's in-process work on bench_serve's phase 1 load, without MQTT or the store.

    python bench/bench_engine_live.py [--baseline-tree DIR] [--rounds 3]

Decodes phase 1's 6,144 batches (512 nodes x 8 ranks x 60 steps, 5 steps per batch), feeds each
event to the engine and the stall watch as `JobTable._process_progress` does, and after every
512 batches (5 steps of every rank) diagnoses and compacts the job as the daemon does after a
diagnosis. Prints CPU microseconds per event for the feeding and milliseconds per diagnosis
(with its compaction), best of `--rounds`. `--baseline-tree` runs another checkout (e.g.
`git archive HEAD~1 | tar -x -C DIR`) in a subprocess, alternating rounds, for a same-run ratio.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time
from collections import deque

HERE = os.path.dirname(os.path.abspath(__file__))


def measure(rounds: int) -> dict[str, float]:
    from bench_serve import progress  # this bench directory's event shapes
    from denpex_agent import wire
    from denpex_agent.rules import load_rules
    from denpexd.engine import Engine
    from denpexd.jobs import id_key
    from denpexd.serve import GC_THRESHOLD
    from denpexd.stall import StallWatch

    job = "bench-engine"
    payloads = []
    for chunk in range(0, 60, 5):
        for ni in range(512):
            node = f"n{ni:03d}"
            evs = [
                progress(job, node, ni * 8 + lr, lr, s, 1.8e9 + s * 0.5)
                for s in range(chunk, chunk + 5)
                for lr in range(8)
            ]
            payloads.append(wire.encode_batch(f"{node}-agent", job, node, 1, time.time(), evs))
    n = 40 * len(payloads)
    rules = load_rules()
    # the daemon's collector settings (denpexd.serve), with this bench's payloads frozen as its
    # start-up objects are: otherwise the figure is mostly the collector walking the payloads
    gc.collect()
    gc.freeze()
    gc.set_threshold(GC_THRESHOLD, 20, 20)
    best_feed = best_diag = float("inf")
    for _ in range(rounds):
        eng, watch = Engine(job, rules), StallWatch(factor=2, floor_s=60, pause_s=600)
        ids: dict[object, None] = {}
        order: deque[object] = deque()
        feed = diag = 0.0
        for k in range(0, len(payloads), 512):
            c0 = time.process_time()
            for p in payloads[k : k + 512]:
                for ev in wire.decode_batch(p, job).events:
                    eid = id_key(ev.id)
                    if eid in ids:
                        continue
                    ids[eid] = None
                    order.append(eid)
                    eng.add_progress(ev)
                    watch.progress(ev, 1.0)
            c1 = time.process_time()
            eng.diagnose()
            eng.compact()
            watch.compact(eng.kept_step, eng.track_keys())
            feed, diag = feed + c1 - c0, diag + time.process_time() - c1
        best_feed, best_diag = min(best_feed, feed), min(best_diag, diag)
    return {
        "feed_us_per_event": round(best_feed / n * 1e6, 3),
        "diagnosis_ms": round(best_diag / 12 * 1e3, 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--baseline-tree", help="another checkout's root, measured in alternating rounds")
    ap.add_argument("--tree", help=argparse.SUPPRESS)  # internal: measure this tree in this process
    args = ap.parse_args()
    if args.tree is not None:
        print(json.dumps(measure(args.rounds)))
        return
    trees = {"this": os.path.dirname(HERE)}
    if args.baseline_tree:
        trees = {"baseline": os.path.abspath(args.baseline_tree), **trees}
    out: dict[str, list[dict[str, float]]] = {k: [] for k in trees}
    for _ in range(args.rounds):
        for name, tree in trees.items():
            env = dict(
                os.environ, PYTHONPATH=os.pathsep.join([f"{tree}/agents", f"{tree}/daemon", tree, HERE])
            )
            got = subprocess.run([sys.executable, __file__, "--tree", tree, "--rounds", "1"], env=env,
                                 check=True, capture_output=True, text=True)  # fmt: skip
            out[name].append(json.loads(got.stdout))
    result = {name: {k: min(r[k] for r in runs) for k in runs[0]} for name, runs in out.items()}
    if "baseline" in result:
        result["ratio"] = {k: round(result["this"][k] / result["baseline"][k], 3) for k in result["this"]}
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
