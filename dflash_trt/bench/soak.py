"""`dflash-trt bench soak`: does `dflash-trt serve` hold its memory over thousands of requests?

Starts `dflash-trt serve --port 0` on the demo models (or --target/--drafter; or drives a server already
running, --url with --pid), then sends waves of --concurrency concurrent requests to /v1/completions, in
thirds: streamed to the end, cut mid-stream (the client hangs up after the first chunk), and malformed (a
body that is not JSON, a field of the wrong type, an unknown model field value, a prompt past the context:
each answered 400 without engine work). Prompts are of ragged lengths (the allocator sees every shape). After
every wave it reads the server's resident set size (VmRSS, /proc/<pid>/status).

Prints a table (RSS at the start, at the middle, at the end; growth over the run's second half) and writes
--out/results.json (settings, per-wave RSS curve, status counts, growth) and --out/rss.png.
The growth over the second half is the flatness figure: a server that keeps something per request grows
there as in the first half; one that only warms up (allocator arenas, the kernels' first shapes) does not.

    make bench-soak
    dflash-trt bench soak --requests 5040 --max-tokens 8
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from dflash_trt.settings import REPO_ROOT

FLAT_LIMIT = 0.05  # the second half's RSS growth a server that runs for days may show at most
WORDS = "def return import class self value items result data index count list name path for while if else".split()


@dataclass
class Tally:
    statuses: dict[str, int] = field(default_factory=dict)

    def add(self, kind: str, status: int | str) -> None:
        key = f"{kind}:{status}"
        self.statuses[key] = self.statuses.get(key, 0) + 1


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for process {pid}")


def prompt(rng: random.Random) -> str:
    """Ragged prompt lengths: 4 to 64 words, so every request's shapes differ from its neighbours'."""
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 64)))


def malformed(i: int, rng: random.Random, max_tokens: int) -> tuple[bytes, dict[str, str]]:
    """One of four bodies the server must refuse with 400 (body, headers), in turn."""
    json_headers = {"content-type": "application/json"}
    kind = i % 4
    if kind == 0:
        return b'{"prompt": "def f(", "max_tokens": ', json_headers  # cut-off JSON
    if kind == 1:
        return json.dumps({"prompt": prompt(rng), "max_tokens": "many"}).encode(), json_headers
    if kind == 2:
        return json.dumps({"prompt": prompt(rng), "max_tokens": max_tokens, "temperature": -3}).encode(), json_headers
    return json.dumps({"prompt": prompt(rng), "max_tokens": 10**7}).encode(), json_headers  # past the context


async def streamed(client: httpx.AsyncClient, body: dict[str, Any], cut: bool) -> int | str:
    """A streamed completion read to [DONE], or cut after its first event (the connection closed)."""
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            await r.aread()
            return r.status_code
        async for line in r.aiter_lines():
            if cut and line.startswith("data:"):
                return "cut"
            if line == "data: [DONE]":
                return 200
    return "eof"


async def one(client: httpx.AsyncClient, i: int, rng: random.Random, max_tokens: int, tally: Tally) -> None:
    body = {"prompt": prompt(rng), "max_tokens": max_tokens, "stream": True, "temperature": rng.choice([0.0, 1.0])}
    part = i % 3
    try:
        if part == 0:
            tally.add("stream", await streamed(client, body, cut=False))
        elif part == 1:
            tally.add("cut", await streamed(client, body, cut=True))
        else:
            content, headers = malformed(i // 3, rng, max_tokens)
            r = await client.post("/v1/completions", content=content, headers=headers)
            tally.add("malformed", r.status_code)
    except httpx.HTTPError as e:
        tally.add(["stream", "cut", "malformed"][part], type(e).__name__)


async def soak(args: argparse.Namespace, url: str, pid: int) -> dict[str, Any]:
    rng = random.Random(args.seed)
    tally, curve = Tally(), []
    limits = httpx.Limits(max_connections=args.concurrency, max_keepalive_connections=args.concurrency)
    start = time.monotonic()
    async with httpx.AsyncClient(base_url=url, timeout=args.timeout, limits=limits) as client:
        curve.append({"requests": 0, "seconds": 0.0, "rss_mib": rss_kib(pid) / 1024})
        sent = 0
        while sent < args.requests and time.monotonic() - start < 60 * args.max_minutes:
            n = min(args.concurrency, args.requests - sent)
            await asyncio.gather(*(one(client, sent + k, rng, args.max_tokens, tally) for k in range(n)))
            sent += n
            point = {"requests": sent, "seconds": round(time.monotonic() - start, 2), "rss_mib": rss_kib(pid) / 1024}
            curve.append(point)
            if len(curve) % 10 == 0:
                print(f"{sent:6d} requests  {point['seconds']:7.1f} s  RSS {point['rss_mib']:7.1f} MiB", flush=True)
    return {"curve": curve, "statuses": dict(sorted(tally.statuses.items())), "seconds": time.monotonic() - start}


def growth(curve: list[dict[str, Any]]) -> dict[str, Any]:
    """RSS at the start, middle and end, and the second half's growth: the end (median of the last tenth of the
    waves, so one wave's noise does not decide) over the middle wave's RSS."""
    rss = [p["rss_mib"] for p in curve]
    mid = rss[len(rss) // 2]
    tail = sorted(rss[-max(1, len(rss) // 10) :])
    end = tail[len(tail) // 2]
    return {
        "start_mib": rss[0],
        "first_wave_mib": rss[1] if len(rss) > 1 else rss[0],
        "mid_mib": mid,
        "end_mib": end,
        "max_mib": max(rss),
        "second_half_growth": (end - mid) / mid,
        "flat": (end - mid) / mid < FLAT_LIMIT,
    }


def plot(curve: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.plot([p["requests"] for p in curve], [p["rss_mib"] for p in curve], marker=".", linewidth=1)
    ax.axvline(curve[len(curve) // 2]["requests"], color="grey", linestyle=":", label="second half")
    ax.set_xlabel("requests")
    ax.set_ylabel("server RSS (MiB)")
    ax.set_title("dflash-trt serve: RSS over the soak (after each wave)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def table(run: dict[str, Any], g: dict[str, Any]) -> str:
    rows = [
        ("requests", f"{run['curve'][-1]['requests']}"),
        ("duration", f"{run['seconds']:.0f} s"),
        ("RSS before the first request", f"{g['start_mib']:.1f} MiB"),
        ("RSS after the first wave", f"{g['first_wave_mib']:.1f} MiB"),
        ("RSS at the middle", f"{g['mid_mib']:.1f} MiB"),
        ("RSS at the end (median, last tenth)", f"{g['end_mib']:.1f} MiB"),
        ("RSS max", f"{g['max_mib']:.1f} MiB"),
        ("growth over the second half", f"{100 * g['second_half_growth']:+.2f} % (limit {100 * FLAT_LIMIT:.0f} %)"),
    ]
    rows += [(f"responses {k}", str(v)) for k, v in run["statuses"].items()]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"| {k:<{width}} | {v:>26} |" for k, v in rows)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--requests", type=int, default=5040, help="requests in all (default 5040: 105 waves of 48)")
    ap.add_argument("--concurrency", type=int, default=48, help="requests per wave, sent at once (default 48)")
    ap.add_argument("--max-tokens", type=int, default=8, help="tokens per completion (default 8: the run is minutes)")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads of the server")
    ap.add_argument("--url", default=None, help="drive this running server instead of starting one (needs --pid)")
    ap.add_argument("--pid", type=int, default=None, help="the process id of the --url server (its RSS is read)")
    ap.add_argument(
        "--max-minutes",
        type=float,
        default=float("inf"),
        help="stop after the wave that ends past this many minutes (the results say how many requests ran)",
    )
    ap.add_argument("--timeout", type=float, default=300.0, help="per-request client timeout in seconds")
    ap.add_argument("--seed", type=int, default=0, help="prompts, temperatures and malformed bodies (default 0)")
    ap.add_argument("--out", type=Path, default=REPO_ROOT / "results/soak", help="output folder")


def run(args: argparse.Namespace) -> int:
    from dflash_trt.server.process import start_serve

    if (args.url is None) != (args.pid is None):
        raise SystemExit("--url and --pid go together")
    args.out.mkdir(parents=True, exist_ok=True)
    proc = None
    url, pid = args.url, args.pid
    if url is None:
        serve = ["--target", str(args.target), "--drafter", str(args.drafter), "--max-queue", str(2 * args.concurrency)]
        serve += ["--threads", str(args.threads)] if args.threads else []
        proc, url = start_serve(serve, args.out / "serve.log", timeout_s=300, env={"DFLASH_TRT_API_KEY": ""})
        pid = proc.pid
    try:
        run = asyncio.run(soak(args, url, pid))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(60)
    g = growth(run["curve"])
    settings = {k: v for k, v in vars(args).items() if k not in ("out", "url", "pid")}
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in settings.items()}
    settings["max_minutes"] = None if settings["max_minutes"] == float("inf") else settings["max_minutes"]
    result = {"settings": settings, **run, **g}
    (args.out / "results.json").write_text(json.dumps(result, indent=1))
    plot(run["curve"], args.out / "rss.png")
    print(table(run, g))
    print(f"wrote {args.out / 'results.json'} and {args.out / 'rss.png'}")
    return 0 if g["flat"] else 1
