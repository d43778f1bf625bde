"""How long ``collate`` takes to turn a batch of samples into trainer tensors.

Run::

    python benchmarks/collate.py            # 1024 samples, prompts <= 512, responses <= 2048
    python benchmarks/collate.py --quick    # 128 samples, for a smoke run

Samples are ``RolloutSample`` objects as the pipeline hands them over (Python lists of ids,
mask and logprobs, a reward), prompt lengths uniform in [128, 512] and response lengths in
[1024, 2048] (about 2k tokens per sample), budgets 512 / 2048 (verl's fixed shapes). Figures:

* ``collate`` to numpy and to torch (the torch path wraps the numpy arrays without a copy);
* a per-sample torch baseline that pads each sample on its own and concatenates, the way an
  agent loop's post-processing commonly does it, for scale;
* ``to_verl_batch`` (collate plus the non-tensor columns);
* ``routed_experts`` of a Qwen3-30B-A3B-shaped MoE (48 MoE layers, top-8, int16) on a
  smaller batch (the tensor alone is 48 * 8 * 2 bytes per token).

Each figure is the median of ``--repeat`` runs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from _common import write_result

from pipeline import RolloutSample
from pipeline.batch import collate, to_verl_batch

PAD = 0


def make_samples(num: int, *, seed: int, routes: tuple[int, int] | None = None
                 ) -> list[RolloutSample]:
    rng = np.random.default_rng(seed)
    samples = []
    for i in range(num):
        p, r = int(rng.integers(128, 513)), int(rng.integers(1024, 2049))
        mask = np.ones(r, dtype=np.int64)
        mask[r // 3: r // 3 + 40] = 0  # a tool response in the middle
        samples.append(RolloutSample(
            uid=f"s{i}", group_id=f"g{i // 8}", index=i,
            prompt_ids=rng.integers(1, 150_000, p).tolist(),
            response_ids=rng.integers(1, 150_000, r).tolist(),
            response_mask=mask.tolist(),
            logprobs=(-rng.random(r)).tolist(),
            reward=float(rng.random()), status="completed", finish_reason="stop",
            exit_reason="done",
            routed_experts=None if routes is None else rng.integers(
                0, 128, (p + r - 1, *routes), dtype=np.int16)))
    return samples


def per_sample_torch(samples: list[RolloutSample], max_p: int, max_r: int) -> dict[str, Any]:
    """Baseline: pad every sample as its own tensors, then concatenate."""
    import torch
    import torch.nn.functional as F

    parts: dict[str, list[Any]] = {k: [] for k in ("prompts", "responses", "response_mask",
                                                   "attention_mask", "rollout_log_probs")}
    for s in samples:
        p, r = torch.tensor(s.prompt_ids), torch.tensor(s.response_ids)
        parts["prompts"].append(F.pad(p, (max_p - len(p), 0), value=PAD)[None])
        parts["responses"].append(F.pad(r, (0, max_r - len(r)), value=PAD)[None])
        parts["response_mask"].append(F.pad(torch.tensor(s.response_mask),
                                            (0, max_r - len(r)))[None])
        parts["attention_mask"].append(torch.cat([
            F.pad(torch.ones(len(p), dtype=torch.long), (max_p - len(p), 0)),
            F.pad(torch.ones(len(r), dtype=torch.long), (0, max_r - len(r)))])[None])
        parts["rollout_log_probs"].append(F.pad(torch.tensor(s.logprobs or []),
                                                (0, max_r - len(r)))[None])
    out = {k: torch.cat(v) for k, v in parts.items()}
    out["input_ids"] = torch.cat([out["prompts"], out["responses"]], dim=1)
    out["position_ids"] = (out["attention_mask"].cumsum(-1) - 1).clamp(min=0)
    return out


def median_s(fn: Callable[[], object], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="128 samples, 3 repeats")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    num = 128 if args.quick else 1024
    num_routed = 32 if args.quick else 256
    repeat = 3 if args.quick else args.repeat
    max_p, max_r = 512, 2048
    budget = {"pad_token_id": PAD, "max_prompt_len": max_p, "max_response_len": max_r}

    samples = make_samples(num, seed=0)
    tokens = sum(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    collate(samples, **budget)  # warm-up (imports torch)
    figures: dict[str, Any] = {
        "loadavg_1m_at_start": os.getloadavg()[0],  # other work on the machine skews figures
        "samples": num, "tokens": tokens, "max_prompt_len": max_p, "max_response_len": max_r,
        "collate_numpy_s": median_s(lambda: collate(samples, return_tensors="np", **budget),
                                    repeat),
        "collate_torch_s": median_s(lambda: collate(samples, **budget), repeat),
        "per_sample_torch_baseline_s": median_s(lambda: per_sample_torch(samples, max_p, max_r),
                                                repeat),
        "to_verl_batch_s": median_s(lambda: to_verl_batch(samples, use_verl=False, **budget),
                                    repeat),
    }
    figures["collate_torch_tokens_per_s"] = tokens / figures["collate_torch_s"]

    routed = make_samples(num_routed, seed=1, routes=(48, 8))
    routed_tokens = sum(len(s.prompt_ids) + len(s.response_ids) for s in routed)
    out = collate(routed, **budget)
    unrouted = [s.model_copy(update={"routed_experts": None}) for s in routed]
    figures["routed"] = {
        "samples": num_routed, "tokens": routed_tokens, "num_layers": 48, "topk": 8,
        "dtype": str(out["routed_experts"].dtype),
        "routed_experts_bytes": out["routed_experts"].nbytes,
        "collate_torch_s": median_s(lambda: collate(routed, **budget), repeat),
        "collate_torch_without_routes_s": median_s(lambda: collate(unrouted, **budget),
                                                   repeat),
    }
    del out
    for key, value in figures.items():
        print(f"{key:>32}: {value}")
    print("wrote", write_result("collate", figures))


if __name__ == "__main__":
    main()
