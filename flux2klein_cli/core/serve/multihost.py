"""Serving from several processes (a multi-host TPU slice, or CPU processes with --coordinator):
process 0 takes HTTP and batches; before it runs a batch it broadcasts the batch's plans over
JAX's distributed runtime, and every other process runs the same batch with it, in the same
order, until process 0 broadcasts the stop.

Plans travel as JSON plus their arrays in an .npz (no pickle: nothing received is executed),
padded to a power of two bytes so the broadcast compiles for a few message sizes only.
"""

from __future__ import annotations

import dataclasses
import io
import json
import logging
import signal
import zipfile
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from flux2klein_cli.core.engine.plan import RunPlan
from flux2klein_cli.core.pipeline.geometry import LatentGeometry

log = logging.getLogger("flux2klein.serve")
_MIN_MESSAGE = 4096  # bytes: the smallest broadcast (a power of two)


# ----------------------------------------------------------------------------- plans as bytes


def _encode(value: Any, arrays: dict[str, np.ndarray], where: str) -> Any:
    if isinstance(value, np.ndarray):
        arrays[where] = value
        return {"array": where}
    if isinstance(value, LatentGeometry):
        return {"geometry": dataclasses.asdict(value)}
    if isinstance(value, tuple):
        return {"tuple": [_encode(v, arrays, f"{where}.{i}") for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [_encode(v, arrays, f"{where}.{i}") for i, v in enumerate(value)]
    if value is None or isinstance(value, bool | int | float | str):
        return value
    raise TypeError(f"a plan field holds a {type(value).__name__}, which does not travel")


def _decode(value: Any, arrays: Any) -> Any:
    if isinstance(value, dict):
        if "array" in value:
            return arrays[value["array"]]
        if "geometry" in value:
            return LatentGeometry(**value["geometry"])
        return tuple(_decode(v, arrays) for v in value["tuple"])
    if isinstance(value, list):
        return [_decode(v, arrays) for v in value]
    return value


def encode_plans(plans: Sequence[RunPlan] | None) -> bytes:
    """A batch's plans (None: the stop) as bytes."""
    arrays: dict[str, np.ndarray] = {}
    header = None if plans is None else [
        {f.name: _encode(getattr(plan, f.name), arrays, f"{i}.{f.name}") for f in dataclasses.fields(plan)}
        for i, plan in enumerate(plans)]
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as archive:
        archive.writestr("plans.json", json.dumps(header))
        data = io.BytesIO()
        np.savez(data, **arrays)
        archive.writestr("arrays.npz", data.getvalue())
    return out.getvalue()


def decode_plans(data: bytes) -> list[RunPlan] | None:
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        header = json.loads(archive.read("plans.json"))
        arrays = np.load(io.BytesIO(archive.read("arrays.npz")), allow_pickle=False)
        if header is None:
            return None
        return [RunPlan(**{name: _decode(value, arrays) for name, value in fields.items()}) for fields in header]


# ----------------------------------------------------------------------------- the broadcast


def _padded(n: int) -> int:
    return max(_MIN_MESSAGE, 1 << (n - 1).bit_length())


def broadcast(data: bytes | None) -> bytes:
    """Process 0's `data` on every process (the others pass None)."""
    from jax.experimental import multihost_utils

    length = multihost_utils.broadcast_one_to_all(np.asarray([0 if data is None else len(data)], np.int32))
    n = int(np.asarray(length)[0])
    buffer = np.zeros(_padded(n), np.uint8)
    if data is not None:
        buffer[:n] = np.frombuffer(data, np.uint8)
    received = multihost_utils.broadcast_one_to_all(buffer)
    return np.asarray(received, np.uint8)[:n].tobytes()


class Lockstep:
    """Process 0's side: each batch is broadcast, then run here as everywhere."""

    def __init__(self, run_batch: Callable[[Sequence[RunPlan]], Sequence[Any]],
                 send: Callable[[bytes], bytes] = broadcast):
        self._run_batch, self._send = run_batch, send
        self.stopped = False

    def run_batch(self, plans: Sequence[RunPlan]) -> Sequence[Any]:
        self._send(encode_plans(plans))
        return self._run_batch(plans)

    def stop(self) -> None:
        """Tell the other processes to stop (once)."""
        if not self.stopped:
            self.stopped = True
            self._send(encode_plans(None))


def follow(run_batch: Callable[[Sequence[RunPlan]], Sequence[Any]], note: Callable[[str], None],
           receive: Callable[[], bytes] = lambda: broadcast(None)) -> int:
    """A process other than 0: run every batch process 0 broadcasts until it says stop; returns
    the batches run. A batch that fails here failed on process 0 too: it answered its requests."""
    def wait_for_stop(signum: int, frame: Any) -> None:  # the slice stops when process 0 says so
        note("a stop signal: waiting for process 0 to drain (a second one exits at once)")
        signal.signal(signum, signal.SIG_DFL)

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, wait_for_stop)
    batches = 0
    while (plans := decode_plans(receive())) is not None:
        try:
            run_batch(plans)
        except Exception as e:  # noqa: BLE001 (kept in step with process 0, which reports it)
            log.warning("a batch of %d plan(s) failed on this process too: %s", len(plans), e)
        batches += 1
    return batches
