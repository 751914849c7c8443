"""`serve` end to end: check, load the engine once, warm, listen, and stop gracefully.

SIGTERM / SIGINT: /readyz turns 503 and /v1 refuses new requests (503); requests already queued or
running get `drain_timeout` seconds to finish, what is left is answered 503, and the process
exits 0. A second signal exits at once (exit 1).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from flux2klein_cli.core.engine.cost import Admission, Demand
from flux2klein_cli.core.engine.opening import Opening
from flux2klein_cli.core.engine.plan import ModelFacts
from flux2klein_cli.core.errors import FieldError, Flux2KleinError
from flux2klein_cli.core.extras import require_serve
from flux2klein_cli.core.serve.batcher import Draining
from flux2klein_cli.core.serve.options import ServeOptions, check_serve_options

log = logging.getLogger("flux2klein.serve")
Note = Callable[[str], None]


def check_serve(options: ServeOptions) -> None:
    """What can fail before the model is known: the extra, the server's own options."""
    require_serve()
    check_serve_options(options)


def check_warm(options: ServeOptions, facts: ModelFacts, admission: Admission | None = None) -> None:
    """Each --warm size by the one size rule at the model's multiple, and (with the `admission`) its
    largest batch within what the host holds: a start-up refusal naming the option."""
    from flux2klein_cli.core.engine.plan import RunFields, build_plan

    for width, height in options.warm:
        try:
            plan = build_plan(RunFields(prompts=("warm-up",), height=height, width=width,
                                        max_sequence_length=options.max_sequence_length), facts)
            if admission is not None:
                admission.check(Demand(plan, batch=options.max_batch))
        except FieldError as e:
            raise FieldError("warm", f"size {width}x{height}: {e}") from None


def drain(service: Any, timeout: float, stop: Callable[[], None], note: Note) -> None:
    """Stop taking work, let what was taken finish within `timeout` s, refuse the rest, then `stop`."""
    service.draining = True
    service.batcher.stop_accepting()
    pending = service.batcher.in_flight
    note(f"draining: {pending} request(s) in flight, up to {timeout:g} s")
    if not service.batcher.wait_idle(timeout):
        refused = service.batcher.refuse_pending(Draining())
        note(f"drain timeout: {refused} request(s) answered 503")
    service.batcher.close()
    stop()


def serve(options: ServeOptions, resolve: Callable[[str], Path], *, warn: Note, note: Note) -> None:
    """Run the server until a signal stops it (returns after a clean drain)."""
    check_serve(options)
    import uvicorn

    from flux2klein_cli.core.serve.app import create_app
    from flux2klein_cli.core.serve.metrics import Metrics
    from flux2klein_cli.core.serve.service import Service

    opening: Opening[None] = Opening(options.engine, resolve, lambda facts: check_warm(options, facts), on_phase=note)
    admission = opening.resolve()
    check_warm(options, opening.facts, admission)
    engine = opening.load(warn)
    import jax

    lockstep = None
    if jax.process_count() > 1:  # process 0 serves; every process runs each batch
        from flux2klein_cli.core.serve.multihost import Lockstep, follow

        if jax.process_index() != 0:
            note(f"process {jax.process_index()} of {jax.process_count()}: running process 0's batches")
            note(f"stopped after {follow(engine.run_batch, note)} batch(es)")
            return
        lockstep = Lockstep(engine.run_batch)
    metrics = Metrics(options.max_batch)
    service = Service(engine, options, metrics, run_batch=lockstep.run_batch if lockstep else None,
                      admission=admission)

    class DrainingServer(uvicorn.Server):
        """uvicorn's server whose first signal drains (ours) and second exits at once."""

        def handle_exit(self, sig: int, frame: Any) -> None:  # no re-raise after shutdown: exit 0
            if service.draining:
                os._exit(1)
            threading.Thread(target=drain, args=(service, options.drain_timeout, self._stop, note),
                             name="flux2klein-drain", daemon=True).start()

        def _stop(self) -> None:
            self.should_exit = True

    config = uvicorn.Config(create_app(service), host=options.host, port=options.port, lifespan="off",
                            log_level="warning", access_log=False, timeout_graceful_shutdown=10,
                            server_header=False)
    server = DrainingServer(config)
    service.batcher.start()  # warms on the worker thread; /readyz turns 200 after it
    threading.Thread(target=_report_ready, args=(service, options, server, note), daemon=True).start()
    try:
        server.run()
    finally:
        # The stop goes after the worker's last batch: the processes' collectives stay in order.
        if lockstep is not None and service.batcher.join(timeout=options.drain_timeout + 60):
            lockstep.stop()
    if service.batcher.start_error is not None:
        raise Flux2KleinError(f"warming up failed: {service.batcher.start_error}")
    if not service.draining:  # uvicorn stopped on its own
        raise Flux2KleinError(f"the server on {options.host}:{options.port} stopped: see the lines above")
    note("stopped")


def _report_ready(service: Any, options: ServeOptions, server: Any, note: Note) -> None:
    service.batcher.started.wait()
    if service.batcher.start_error is not None:
        server.should_exit = True
        return
    warm = f", warm: {', '.join(f'{w}x{h}' for w, h in options.warm)}" if options.warm else ""
    note(f"ready: http://{options.host}:{options.port} serving {service.model}{warm}")
