"""``stagewise serve``: an OpenAI-compatible HTTP server in front of a pipeline
(:func:`~stagewise.serve.app.build_app`; the request traffic in :mod:`stagewise.serve.loop`)."""
