"""Helpers the tests share, imported as ``helpers.<module>`` (tests/conftest.py puts tests/ on the
path): kernel-test devices and tolerances (:mod:`~helpers.kernels`), process checks
(:mod:`~helpers.processes`), quantised-linear cases, tiny models of every architecture
(:mod:`~helpers.hf_models`), small Qwen3-VL models, GGUF writers, the
context-parallel scenario, the compact KV cache's models, runs and tolerances
(:mod:`~helpers.compact_kv`), a group whose collectives must not run (:mod:`~helpers.groups`), the
documentation example parser and runner, and the scripts some tests
run as other processes (``cp_worker.py``, ``tp_ranks.py``, ``ring_peer.py``)."""
