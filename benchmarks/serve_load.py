"""A bounded load generator for a running `flux2klein serve`: a fixed number of requests at each
concurrency (default 1, 4, 8), printing throughput and p50 / p99 latency (docs/benchmarks.md).

    flux2klein serve --model 4b --warm 512x512 --max-batch 8 &
    python benchmarks/serve_load.py --url http://127.0.0.1:8000 --size 512x512 --requests 64

Only loopback URLs are accepted (it is a benchmark of this host, not a load tool for others'),
every request has a timeout, and the whole run stops after --max-seconds. Each request carries a
distinct seed; 429s are counted apart (and not retried), as are other failures. --json prints one
object per concurrency level on stdout. With --partial-images K the requests stream (stream: true)
and the first partial image's latency is measured too (p50 / p99). --output-format picks the format.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from urllib.parse import urlparse

import httpx


@dataclass
class Level:
    concurrency: int
    requests: int
    ok: int
    rejected: int  # 429
    failed: int
    images: int
    seconds: float
    images_per_second: float
    p50_ms: float | None
    p99_ms: float | None
    first_partial_p50_ms: float | None = None  # streamed: from sending to the first partial image event
    first_partial_p99_ms: float | None = None


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


def check_loopback(url: str) -> None:
    host = urlparse(url).hostname or ""
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        sys.exit(f"error: {url} is not a loopback URL; this benchmark only loads a server on this host")


async def level(client: httpx.AsyncClient, args: argparse.Namespace, concurrency: int, deadline: float) -> Level:
    latencies: list[float] = []
    firsts: list[float] = []
    counts = {"ok": 0, "rejected": 0, "failed": 0, "images": 0}
    next_index = 0

    async def worker() -> None:
        nonlocal next_index
        while next_index < args.requests and time.monotonic() < deadline:
            index = next_index
            next_index += 1
            body = {"prompt": args.prompt, "size": args.size, "n": args.n, "seed": index,
                    "response_format": "b64_json", "output_format": args.output_format,
                    **({"steps": args.steps} if args.steps else {})}
            start = time.perf_counter()
            try:
                if args.partial_images is not None:
                    status, images, first = await streamed(client, body, args, start)
                    if first is not None:
                        firsts.append(first)
                else:
                    response = await client.post("/v1/images/generations", json=body, timeout=args.timeout)
                    status = response.status_code
                    images = len(response.json()["data"]) if status == 200 else 0
            except httpx.HTTPError:
                counts["failed"] += 1
                continue
            if status == 200 and images:
                latencies.append(time.perf_counter() - start)
                counts["ok"] += 1
                counts["images"] += images
            elif status == 429:
                counts["rejected"] += 1
            else:
                counts["failed"] += 1

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    seconds = time.perf_counter() - start
    ms = lambda value: None if value is None else round(value * 1000, 1)  # noqa: E731
    return Level(concurrency=concurrency, requests=sum(counts[k] for k in ("ok", "rejected", "failed")),
                 ok=counts["ok"], rejected=counts["rejected"], failed=counts["failed"], images=counts["images"],
                 seconds=round(seconds, 3), images_per_second=round(counts["images"] / seconds, 3) if seconds else 0,
                 p50_ms=ms(percentile(latencies, 50)), p99_ms=ms(percentile(latencies, 99)),
                 first_partial_p50_ms=ms(percentile(firsts, 50)), first_partial_p99_ms=ms(percentile(firsts, 99)))


async def streamed(client: httpx.AsyncClient, body: dict, args: argparse.Namespace,
                   start: float) -> tuple[int, int, float | None]:
    """(status, images completed, seconds to the first partial image) of one streamed request."""
    body = {**body, "stream": True, "partial_images": args.partial_images}
    first, images = None, 0
    async with client.stream("POST", "/v1/images/generations", json=body, timeout=args.timeout) as response:
        if response.status_code != 200:
            return response.status_code, 0, None
        async for line in response.aiter_lines():
            if line == "event: image_generation.partial_image" and first is None:
                first = time.perf_counter() - start
            elif line == "event: image_generation.completed":
                images += 1
            elif line == "event: error":
                return 500, 0, first
    return 200, images, first


async def main(args: argparse.Namespace) -> None:
    key = args.api_key or os.environ.get("FLUX2KLEIN_API_KEY")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    deadline = time.monotonic() + args.max_seconds
    limits = httpx.Limits(max_connections=max(args.concurrency))
    async with httpx.AsyncClient(base_url=args.url, headers=headers, limits=limits) as client:
        ready = await client.get("/readyz", timeout=10)
        if ready.status_code != 200:
            sys.exit(f"error: {args.url}/readyz answered {ready.status_code}; start the server and wait for it")
        if args.warmup:  # one request first, so the first level does not pay a compile
            await client.post("/v1/images/generations", timeout=args.timeout,
                              json={"prompt": args.prompt, "size": args.size, "n": args.n,
                                    **({"steps": args.steps} if args.steps else {})})
        for concurrency in args.concurrency:
            if time.monotonic() >= deadline:
                print(f"stopped: --max-seconds {args.max_seconds:g} reached", file=sys.stderr)
                break
            result = await level(client, args, concurrency, deadline)
            if args.json:
                print(json.dumps(asdict(result)), flush=True)
            else:
                print(f"concurrency {result.concurrency:>3}: {result.ok}/{result.requests} ok, "
                      f"{result.rejected} x 429, {result.failed} failed, {result.images_per_second:.2f} images/s, "
                      f"p50 {result.p50_ms} ms, p99 {result.p99_ms} ms", flush=True)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--api-key", default=None, help="default: FLUX2KLEIN_API_KEY")
    parser.add_argument("--size", default="512x512")
    parser.add_argument("--steps", type=int, default=None, help="default: the model's")
    parser.add_argument("-n", type=int, default=1, help="images per request")
    parser.add_argument("--prompt", default="a lighthouse at dawn, volumetric light")
    parser.add_argument("--output-format", default="png", choices=["png", "jpeg", "webp"])
    parser.add_argument("--partial-images", type=int, default=None, choices=[0, 1, 2, 3],
                        help="stream the requests with this many partial images (default: no stream)")
    parser.add_argument("--requests", type=int, default=32, help="requests per concurrency level (at most 1000)")
    parser.add_argument("--concurrency", type=lambda t: [int(c) for c in t.split(",")], default=[1, 4, 8])
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per request")
    parser.add_argument("--max-seconds", type=float, default=1800.0, help="the whole run stops after this")
    parser.add_argument("--no-warmup", dest="warmup", action="store_false")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if not 1 <= args.requests <= 1000 or not all(1 <= c <= 64 for c in args.concurrency):
        parser.error("--requests must be 1..1000 and each --concurrency 1..64")
    check_loopback(args.url)
    return args


if __name__ == "__main__":
    asyncio.run(main(parse()))
