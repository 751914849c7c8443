"""`serve` over two processes (JAX's distributed runtime on CPU, as on a multi-host slice):
process 0 takes HTTP and sends each batch; process 1 runs every batch with it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from flux2klein_cli.core.engine.plan import RunPlan
from flux2klein_cli.core.pipeline.geometry import LatentGeometry
from flux2klein_cli.core.pipeline.pipeline import UNFIT
from flux2klein_cli.core.serve.multihost import Lockstep, decode_plans, encode_plans, follow
from tests.test_serve import BASE_FLAGS, Server, free_port, png, wait_ready


def _plan(seed: int, **kw: object) -> RunPlan:
    fields: dict[str, object] = dict(
        model="tiny", prompts=("a fox", "a lighthouse"), negative_prompt="", seeds=(seed, seed + 1), num_images=1,
        height=32, width=48, steps=2, guidance=1.0, cfg=False, max_sequence_length=16, kv=False,
        geometry=LatentGeometry(16, 128), reference_names=("a.png",),
        references=(np.linspace(-1, 1, 32 * 48 * 3, dtype=np.float32).reshape(32, 48, 3),))
    return RunPlan(**{**fields, **kw})  # type: ignore[arg-type]


def test_plans_travel_whole_without_pickle() -> None:
    plans = [_plan(3), _plan(9, latents=np.ones((2, 128, 2, 3), np.float32), latents_name="noise.npy")]
    back = decode_plans(encode_plans(plans))
    assert back == plans  # every compared field
    for a, b in zip(back or [], plans, strict=True):
        for name in ("references", "latents"):
            x, y = getattr(a, name), getattr(b, name)
            assert (x is None and y is None) or all(np.array_equal(p, q) for p, q in zip(
                x if isinstance(x, tuple) else (x,), y if isinstance(y, tuple) else (y,), strict=True))
    assert decode_plans(encode_plans(None)) is None
    assert b"pickle" not in encode_plans(plans)  # arrays as plain .npy inside the archive


def test_the_follower_runs_each_batch_in_order_until_the_stop() -> None:
    sent: list[bytes] = []
    ran_here: list[int] = []
    lockstep = Lockstep(lambda plans: ran_here.append(len(plans)) or [], send=lambda data: sent.append(data) or data)
    lockstep.run_batch([_plan(1)])
    lockstep.run_batch([_plan(2), _plan(3)])
    lockstep.stop()
    lockstep.stop()  # once
    ran_there: list[list[int]] = []
    messages = iter(sent)
    batches = follow(lambda plans: ran_there.append([p.seeds[0] for p in plans]), note=lambda m: None,
                     receive=lambda: next(messages))
    assert batches == 2 and ran_here == [1, 2] and ran_there == [[1], [2, 3]]
    for signum in (signal.SIGTERM, signal.SIGINT):  # follow's handlers go back to the defaults here
        signal.signal(signum, signal.SIG_DFL if signum == signal.SIGTERM else signal.default_int_handler)


@pytest.mark.slow
def test_two_processes_serve_as_one(tmp_path: Path) -> None:
    import httpx

    coordinator, port = free_port(), free_port()
    env = {**os.environ, "FLUX2KLEIN_CACHE": str(tmp_path / "cache"), "FLUX2KLEIN_XLA_CACHE": "off",
           "FLUX2KLEIN_COMPILE_CACHE": str(tmp_path / "store"), "JAX_PLATFORMS": "cpu"}
    env.pop("FLUX2KLEIN_API_KEY", None)
    processes, logs = [], []
    for i in range(2):
        logs.append(tmp_path / f"process-{i}.log")
        with logs[-1].open("wb") as out:
            processes.append(subprocess.Popen(
                [sys.executable, "-m", "flux2klein_cli", "serve", *BASE_FLAGS, "--host", "127.0.0.1", "--port",
                 str(port), "--coordinator", f"127.0.0.1:{coordinator}", "--num-processes", "2",
                 "--process-id", str(i)], stdout=out, stderr=out, env=env))
    server = Server(processes[0], port, logs[0])
    try:
        wait_ready(server)
        for seed in (3, 4):
            reply = httpx.post(server.url + "/v1/images/generations", timeout=300, json={
                "prompt": "a red fox", "size": "32x32", "seed": seed, "steps": 1, "response_format": "b64_json"})
            assert reply.status_code == 200, reply.text
            assert png(reply.json()["data"][0]["b64_json"]).size == (32, 32)
        processes[0].send_signal(signal.SIGTERM)
        processes[1].send_signal(signal.SIGTERM)  # as a scheduler stops every pod: process 1 waits for 0
        codes = [p.wait(timeout=180) for p in processes]
    finally:
        for p in processes:
            if p.poll() is None:
                p.kill()
    follower = logs[1].read_text(errors="replace")
    assert codes == [0, 0], logs[0].read_text(errors="replace")[-2000:] + follower[-2000:]
    assert "running process 0's batches" in follower
    for log in (logs[0].read_text(errors="replace"), follower):  # the stored executables ran, no jitted fallback
        assert UNFIT not in log, log[-2000:]
    batches = int(follower.rsplit("stopped after ", 1)[1].split()[0])
    assert batches >= 3, follower  # the warm-up's batch sizes and both requests
    time.sleep(0)
