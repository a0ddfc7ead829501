"""The benchmarks: ``stagewise bench SUITE`` (:mod:`~stagewise.bench.cli`) and ``stagewise plan
validate`` (:mod:`~stagewise.bench.plan_validate`), each against its baselines, into JSON + Markdown.

A suite is a sub-package (its ``__init__`` holds its options and its ``run``; the work is in the
modules beside it), listed once in :data:`stagewise.bench.cli.SUITES`:

- :mod:`~stagewise.bench.kernels`: each op against pure torch, torch.compile and FlashInfer;
- :mod:`~stagewise.bench.e2e`: whole-model generation against transformers and llama.cpp, by stage
  count, TP size and launcher, and through a stage's failure;
- :mod:`~stagewise.bench.transport`: each transport's latency and GB/s (and ``shm``: the ring
  against loopback sockets);
- :mod:`~stagewise.bench.profile`: this machine as a planner device profile;
- :mod:`~stagewise.bench.serve`: ``stagewise serve`` against llama.cpp's OpenAI server under load;
- :mod:`~stagewise.bench.plan_validate`: the planner's predictions against measured runs.

Shared by the suites: :mod:`~stagewise.bench.options` (``--tiny``, ``--threads``, ``--out``),
:mod:`~stagewise.bench.report` (the machine, the results files), :mod:`stagewise.measure.timing`
(the timers, which the runtime's node profile uses too), :mod:`~stagewise.bench.llama_cpp` (the
llama.cpp baseline of e2e and serve), :mod:`~stagewise.bench.regroup` (a model regrouped into other
heads, for e2e --tp and plan validate).

``--tiny`` (or ``STAGEWISE_BENCH_TINY=1`` in the environment) runs any suite at toy sizes with the
fewest repeats: a check that the command works (the documentation's examples run this way), whose
numbers mean nothing.
"""
