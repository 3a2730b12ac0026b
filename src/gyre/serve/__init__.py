"""``gyre serve``: the OpenAI-compatible server around the in-process engine, and its recorder.

The server (:mod:`~gyre.serve.server`), its request bodies and their preparation
(:mod:`~gyre.serve.requests`), the model it serves (:mod:`~gyre.serve.host`), images in requests
(:mod:`~gyre.serve.images`) and the agent-proxy recorder (:mod:`~gyre.serve.recorder`). This is a
product on top of the library: it may import rollout code, and nothing below it imports it.
"""
