"""What OpenAI-compatible vLLM servers say about their load: their Prometheus ``/metrics``
read into one :class:`~pipeline.engines.EngineLoad` for flow control.

vLLM's metric names (V1 engine, vllm 0.24 to 0.32): ``vllm:num_requests_running``,
``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc`` (a 0..1 fraction despite the
name) and the counter ``vllm:num_preemptions`` (exposed as ``..._total``). The text format is
parsed by ``prometheus_client`` (a dependency of vLLM itself), not by hand. Several servers
add up: running, waiting and preemptions are summed, KV use is the fullest server's (the
one that preempts first).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import aiohttp

from pipeline._exceptions import EngineError
from pipeline.engines._base import EngineLoad

RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_USAGE = "vllm:kv_cache_usage_perc"
PREEMPTIONS = "vllm:num_preemptions"


def parse_metrics(text: str) -> dict[str, float]:
    """The vLLM load figures in one ``/metrics`` page, summed over label sets (one per model
    or engine); names missing from the page are missing from the result."""
    from prometheus_client.parser import text_string_to_metric_families

    wanted = {RUNNING, WAITING, KV_USAGE, PREEMPTIONS}
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name not in wanted:
            continue
        for sample in family.samples:
            if sample.name in (family.name, family.name + "_total"):
                out[family.name] = out.get(family.name, 0.0) + float(sample.value)
    return out


async def scrape_load(session: aiohttp.ClientSession, urls: Sequence[str], *,
                      timeout_s: float = 2.0) -> EngineLoad | None:
    """The servers' load read from their ``/metrics`` (concurrently, each within
    ``timeout_s``); None when no server answered with vLLM's figures.

    Raises:
        EngineError: never for a server that fails to answer (it is left out); only
            when ``urls`` is empty.
    """
    if not urls:
        raise EngineError("scrape_load needs at least one server URL")

    async def one(url: str) -> dict[str, float] | None:
        try:
            async with asyncio.timeout(timeout_s), session.get(url + "/metrics") as resp:
                if resp.status != 200:
                    return None
                return parse_metrics(await resp.text())
        except (aiohttp.ClientError, TimeoutError, ValueError):
            return None

    pages = [page for page in await asyncio.gather(*(one(url) for url in urls))
             if page and (RUNNING in page or KV_USAGE in page)]
    if not pages:
        return None
    kv = [page[KV_USAGE] for page in pages if KV_USAGE in page]
    preemptions = [page[PREEMPTIONS] for page in pages if PREEMPTIONS in page]
    return EngineLoad(
        running=int(sum(page.get(RUNNING, 0.0) for page in pages)),
        waiting=int(sum(page.get(WAITING, 0.0) for page in pages)),
        kv_usage=max(kv) if kv else None,
        preemptions=int(sum(preemptions)) if preemptions else None)
