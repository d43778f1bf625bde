"""Images through the proxy (issue 41 item 4): what an image turn costs the proxy, and the
event loop's lag while many sessions send images at once.

    python benchmarks/proxy_images.py [--sessions 32] [--size 448] [--rounds 3]

``--sessions`` sessions run at once over HTTP on 127.0.0.1 against the proxy with the tiny
Qwen2.5-VL's processor (the real models' image settings) and the **simulated** engine (it
answers at once, so the proxy's own work is all there is). Each session holds three chat
turns: a user turn with one ``--size`` x ``--size`` PNG (a data URL), a text turn that sends
the whole history back (the image included: matched by its URL's digest, its tokens reused),
and a turn that adds a second image. The same conversation without images is the baseline.
Reported per turn kind: the proxy's own ``render_s`` and ``total_s`` from the turn records
(p50 and p95, ms), and how late a 5 ms ticker woke up during the image sessions (p50, p99,
max, ms), the image work being on the processor's worker thread. Measured twice: one session
at a time (``alone``: a turn's own cost) and ``--sessions`` at once (``concurrent``: image
turns queue on the processor's one worker thread).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import os
import statistics
import time
from typing import Any

import aiohttp
from _common import write_result
from PIL import Image

from pipeline.multimodal import ensure_tiny_vl_model, tiny_vl_processor
from pipeline.proxy import ProxyServer
from pipeline.testing import SimulatedEngine


def data_url(seed: int, size: int) -> str:
    image = Image.effect_noise((size, size), 40 + seed % 50).convert("RGB")
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def user(text: str, url: str | None) -> dict[str, Any]:
    if url is None:
        return {"role": "user", "content": text}
    return {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                        {"type": "text", "text": text}]}


async def conversation(http: aiohttp.ClientSession, proxy: ProxyServer,
                       pictures: tuple[str, str] | None) -> str:
    session = proxy.create_session()
    url = f"{proxy.session_url(session)}/chat/completions"
    headers = {"Authorization": f"Bearer {session.api_key}"}
    first, second = pictures or (None, None)
    messages: list[dict[str, Any]] = [user("What is in this picture?", first)]
    for follow in (user("Describe it in more detail.", None),
                   user("And this one?", second), None):
        async with http.post(url, json={"messages": messages, "max_tokens": 8},
                             headers=headers) as response:
            body = await response.json()
            assert response.status == 200, body
        if follow is None:
            break
        messages += [{"role": "assistant", "content": body["choices"][0]["message"]["content"]},
                     follow]
    return session.id


async def ticker(lags: list[float], stop: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    while not stop.is_set():
        start = loop.time()
        await asyncio.sleep(0.005)
        lags.append((loop.time() - start - 0.005) * 1000)


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 2)


async def run(args: argparse.Namespace, sessions: int, rounds: int) -> dict[str, Any]:
    processor = tiny_vl_processor(ensure_tiny_vl_model())
    engine = SimulatedEngine(latency_s=0.0, eos_token_id=processor.tokenizer.eos_token_id)
    kinds = ("image", "resend", "second_image")
    times: dict[str, dict[str, list[float]]] = {
        f"{mode}.{kind}": {"render_ms": [], "total_ms": []}
        for mode in ("images", "text") for kind in kinds}
    lags: list[float] = []
    async with ProxyServer(engine, processor.tokenizer, processor=processor,
                           max_sessions=4 * sessions) as proxy, \
            aiohttp.ClientSession() as http:
        # the client's PNGs are made beforehand: their encoding is not the proxy's work
        pictures = [(data_url(i, args.size), data_url(i + 1000, args.size))
                    for i in range(sessions + 1)]
        await conversation(http, proxy, pictures[-1])  # warm-up: threads, caches
        for _ in range(rounds):
            for mode in ("images", "text"):
                stop = asyncio.Event()
                tick = asyncio.create_task(ticker(lags if mode == "images" else [], stop))
                ids = await asyncio.gather(*(conversation(
                    http, proxy, pictures[i] if mode == "images" else None)
                    for i in range(sessions)))
                stop.set()
                await tick
                for sid in ids:
                    for kind, turn in zip(kinds, proxy.record(sid).turns, strict=True):
                        cell = times[f"{mode}.{kind}"]
                        cell["render_ms"].append(turn.timings["render_s"] * 1000)
                        cell["total_ms"].append(turn.timings["total_s"] * 1000)
                    await proxy.delete_session(sid)
    figures: dict[str, Any] = {
        "sessions": sessions, "rounds": rounds,
        "turns": {name: {f"{key}_p50": round(statistics.median(values), 2)
                         for key, values in cell.items()}
                  | {f"{key}_p95": pct(values, 0.95) for key, values in cell.items()}
                  for name, cell in times.items()},
        "loop_lag_ms": {"p50": pct(lags, 0.5), "p99": pct(lags, 0.99),
                        "max": round(max(lags), 2)}}
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sessions", type=int, default=32)
    parser.add_argument("--size", type=int, default=448)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    started = time.perf_counter()
    figures: dict[str, Any] = {"engine": "simulated (answers at once)", "image_size": args.size,
                               "loadavg_at_start": [round(x, 2) for x in os.getloadavg()]}
    # one session at a time: the cost of a turn; then --sessions at once: the queue on the
    # processor's one worker thread, and the event loop's lag meanwhile
    for name, sessions, rounds in (("alone", 1, 4 * args.rounds),
                                   ("concurrent", args.sessions, args.rounds)):
        figures[name] = asyncio.run(run(args, sessions, rounds))
        print(f"{name}: {sessions} session(s) at once, {rounds} rounds")
        for kind, cell in figures[name]["turns"].items():
            print(f"  {kind:22s} " + "  ".join(f"{k}={v}" for k, v in cell.items()))
        print("  loop lag (ms, image sessions):", figures[name]["loop_lag_ms"])
    figures["wall_s"] = round(time.perf_counter() - started, 1)
    print("wrote", write_result("proxy_images", figures))


if __name__ == "__main__":
    main()
