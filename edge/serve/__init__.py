"""`hybridspec edge serve`: an OpenAI-compatible HTTP front for one long-lived edge worker.

config.py holds the server's settings, schema.py the request and response bodies, responses.py
how they are built (whole or as server-sent events), errors.py the OpenAI error shape and its
statuses, limits.py the admission bound and the body-size limit, generation.py one generation on a
worker thread, metrics.py the Prometheus metrics, app.py the FastAPI app that ties them together.
"""
