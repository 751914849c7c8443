"""`flux2klein serve`: the OpenAI Images API over one long-lived engine (the [serve] extra).

options.py   what a server is built with, checked before anything loads (host / key rules)
batcher.py   the bounded queue and the one worker thread that runs same-key plans as one batch
jobs.py      asynchronous jobs: ids, states, results, cancelling a queued one
metrics.py   prometheus_client metrics in a registry of the server's own
service.py   requests' fields -> plans -> tickets -> PNGs; errors in OpenAI's shape
app.py       the FastAPI app: routes, body bound, API key, draining
server.py    load, warm, uvicorn, SIGTERM drain

Only options.py, batcher.py, jobs.py and service.py import nothing of the extra at module
level; the others import fastapi, uvicorn and prometheus_client inside functions, so the
package imports on a base install and `serve` can say which extra it needs.
"""
