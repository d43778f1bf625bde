"""What a sample's token lists cost the collector and memory, by length: Python lists (what
``RolloutSample`` and the item hold today) against typed arrays (issue 43).

Run::

    python benchmarks/token_containers.py            # 256 / 1,024 / 4,096 tokens per response
    python benchmarks/token_containers.py --quick    # print only

Each sample is what the trainer view keeps of one response: ``response_ids`` (token ids drawn
from a 151,665-token vocabulary, as Qwen's: almost all above 256, so each is an int object of
its own), ``logprobs`` (floats) and ``response_mask`` (ones), held as three Python lists or as
three ``array.array`` (``"i"``, ``"f"``, ``"b"``). Per length and container: Python memory per
sample (tracemalloc), the time of one full collection per sample (median of 3
``gc.collect()`` with every sample alive) and the objects the collector tracks. A list is
walked element by element on every full pass (each element's header is read, in a heap of
gigabytes mostly a cache miss); an array is tracked too on Python 3.11, but holds raw numbers,
so a pass visits only its type, whatever its length. The full passes of
a batch cost about four such walks per object that lives across an engine call (the
performance guide's seventh round), so the per-pass figure times four is what the token
lists add per sample to a batch run under CPython's collector.
"""

from __future__ import annotations

import argparse
import array
import gc
import random
import statistics
import time
import tracemalloc
from typing import Any

from _common import write_result

VOCAB = 151_665


def make_samples(count: int, length: int, kind: str, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        ids = [rng.randrange(VOCAB) for _ in range(length)]
        logprobs = [-rng.expovariate(2.0) for _ in range(length)]
        mask = [1] * length
        if kind == "array":
            out.append({"response_ids": array.array("i", ids),
                        "logprobs": array.array("f", logprobs),
                        "response_mask": array.array("b", mask)})
        else:
            out.append({"response_ids": ids, "logprobs": logprobs, "response_mask": mask})
    return out


def measure(count: int, length: int, kind: str) -> dict[str, Any]:
    gc.collect()
    tracemalloc.start()
    samples = make_samples(count, length, kind, seed=length)
    memory = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    passes = []
    for _ in range(3):
        start = time.perf_counter()
        gc.collect()
        passes.append(time.perf_counter() - start)
    tracked = sum(gc.is_tracked(v) for s in samples for v in s.values())
    full_pass_us = statistics.median(passes) / count * 1e6
    del samples
    return {"samples": count, "tokens": length, "container": kind,
            "python_kb_per_sample": round(memory / count / 1024, 2),
            "full_pass_us_per_sample": round(full_pass_us, 3),
            "batch_passes_us_per_sample_estimate": round(4 * full_pass_us, 2),
            "tracked_token_containers_per_sample": tracked / count}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--samples", type=int, default=10_000)
    parser.add_argument("--quick", action="store_true", help="print only, write nothing")
    parser.add_argument("--name", default="token_containers", help="results file name")
    args = parser.parse_args()
    rows = []
    for length in args.lengths:
        for kind in ("list", "array"):
            rows.append(measure(args.samples, length, kind))
            print(rows[-1], flush=True)
    if not args.quick:
        print(f"written to {write_result(args.name, {'vocabulary': VOCAB, 'rows': rows})}")


if __name__ == "__main__":
    main()
