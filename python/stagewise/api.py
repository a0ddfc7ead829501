"""The public Python API: :class:`Pipeline` loads a model and generates, :class:`Completion` is
one prompt's result.

    with stagewise.Pipeline("smollm2-135m") as pipe:
        [c] = pipe.generate(["What is the capital of France?"], chat=True, max_new_tokens=20)
        print(c.text, c.finish_reason)

With ``stages=1`` (and ``tp=pcp=1``) every layer runs in this process (an
:class:`~stagewise.engine.engine.Engine`); otherwise each rank of each stage is a process of its
own and this one drives them (a :class:`~stagewise.pipeline.driver.PipelineDriver`). Both are a
:class:`~stagewise.frontend.run.Backend` — add a request, cancel it, poll for the requests that
ended — so :meth:`Pipeline.generate` has one path.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from itertools import count
from typing import Any

import torch

from stagewise.engine.params import sampling_keywords
from stagewise.frontend.image_processing import expand_prompts, prepare_prompt_images
from stagewise.frontend.local import LocalBackend
from stagewise.frontend.prompts import check_lengths, encode_prompts, render_chat
from stagewise.frontend.run import Completion, Run, sampling_per_prompt
from stagewise.frontend.text import TextStreams, request_problem
from stagewise.model.loader import Checkpoint, open_checkpoint, resolve_device, resolve_dtype
from stagewise.model.quant import check_precision
from stagewise.parallel.plan_options import option_problems
from stagewise.launch.start import REJOIN_S, Restart, process_options, process_plan

_log = logging.getLogger("stagewise").warning
"""Where a pipeline's restarts are told."""


class Pipeline:
    """A model loaded for generation. ``stages=1`` runs every layer in this process."""

    def __init__(self, model: str | Checkpoint, *, stages: int = 1, tp: int = 1, dcp: int = 1, pcp: int = 1,
                 device: str = "cpu", dtype: str = "auto",
                 max_num_seqs: int = 32, max_model_len: int | None = None, kv_cache_bytes: int | None = None,
                 max_num_tokens: int | None = None, max_prefill_tokens: int = 8192, tpot_target_ms: float | None = None,
                 prefix_cache: bool = True, speculative: str | None = None, num_speculative_tokens: int = 3,
                 kv_cache_dtype: str = "auto", load_progress: Callable[[int, int, int], None] | None = None,
                 quantized: bool | None = None, linear_precision: str = "exact", max_restarts: int = 0,
                 rejoin: bool = True, max_image_pixels: int | None = None, **parallel_options: Any) -> None:
        """``load_progress(done, total, nbytes)`` follows the weight reading (see
        :func:`stagewise.model.loader.load_stage_weights`).

        ``quantized``: whether block-quantised GGUF matrices stay in their blocks (run by
        ``stagewise.ops.quant_linear`` with their exact values); None (the default) keeps them when
        the stage computes in float32, which ``dtype="auto"`` is for a quantised GGUF.

        ``linear_precision``: ``"exact"`` (default) or ``"int8"``, an approximate CPU mode in which
        those blocks multiply with the activations quantised to int8 per block of 32, as llama.cpp
        does on the CPU (:func:`stagewise.ops.quant_linear_int8`): faster decode and prefill, tokens
        that may differ from the exact model's. A dense float32 checkpoint's matmul weights are
        quantised to Q8_0 blocks for it at load.

        ``max_prefill_tokens``: prompt tokens a step runs at most; a longer prompt is prefilled in
        chunks over several steps (chunked prefill), other requests decoding in the same steps.
        ``tpot_target_ms``: a time per output token the running requests keep while new prompts
        start; those wait or run in chunks (:mod:`stagewise.engine.pacing`). None: they start at once.
        ``prefix_cache``: a prompt whose beginning earlier requests computed starts after their KV
        blocks, on every stage (:mod:`stagewise.engine.prefix_cache`); False: from its first token.
        ``kv_cache_dtype``: ``"int8"`` or ``"fp8_e4m3"`` stores K/V as one-byte codes with a scale per
        token and KV head (:data:`stagewise.kv.cache.KV_CACHE_DTYPES`); ``"auto"``: the activations' dtype.
        ``speculative``: ``"ngram"`` drafts up to ``num_speculative_tokens`` tokens per request and
        step by prompt lookup, verified in one step through every stage; the tokens are those of
        decoding without it (greedy) or distributed as them (sampling)
        (:mod:`stagewise.engine.speculative`). None (default): one token per step.

        ``max_image_pixels``: larger input images are refused (default: 2 ** 28 pixels).

        ``tp``: tensor-parallel ranks per stage; ``dcp``: of those, how many shard each KV head's
        sequence (decode context parallel); ``pcp``: prefill-context-parallel ranks per stage
        (each ``tp`` processes more). Any of them above 1 runs every rank as a process, started
        here, or with ``launcher="ray"`` as Ray actors on the cluster at ``ray_address`` (default
        ``RAY_ADDRESS``, else a Ray instance started for the pipeline) placed by ``placement``
        (spread, pack, strict_spread; :mod:`stagewise.launch.ray_cluster`).

        ``max_restarts``: with processes, how many times a pipeline whose stage died or hung is
        started again, its running requests resumed from the tokens they had
        (:mod:`stagewise.pipeline.recovery`; 0: such a failure ends them with an error); with
        ``rejoin`` (default) only the lost stages, the others keeping their layers, where the layout
        allows (:class:`stagewise.launch.start.Restart`), else every stage."""
        check_precision("Pipeline", linear_precision)
        if not isinstance(rejoin, bool):
            raise ValueError(f"Pipeline: rejoin must be True or False, got {rejoin!r}")
        for name, value in (("stages", stages), ("tp", tp), ("dcp", dcp), ("pcp", pcp)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Pipeline: {name} must be an int >= 1, got {value!r}")
        processes = stages * tp * pcp > 1
        pipeline_options, launch_options = process_options(parallel_options, processes, max_restarts)
        for name, value in (("max_num_seqs", max_num_seqs), ("max_prefill_tokens", max_prefill_tokens)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Pipeline: {name} must be an int >= 1, got {value!r}")
        for problem in option_problems({"tpot_target_ms": tpot_target_ms, "prefix_cache": prefix_cache,
                                        "kv_cache_dtype": kv_cache_dtype,
                                        "speculative": speculative, "num_speculative_tokens": num_speculative_tokens}):
            raise ValueError(f"Pipeline: {problem}")
        dev = resolve_device(device, here=launch_options.get("launcher") != "ray")  # Ray's nodes have the GPUs
        if linear_precision == "int8" and dev.type != "cpu":
            raise NotImplementedError(f"Pipeline: linear_precision='int8' runs on the CPU only, got device={device!r}")
        start = time.perf_counter()
        ckpt = open_checkpoint(model)
        self._open(ckpt, dev, resolve_dtype(dtype, ckpt.config.dtype))
        if max_image_pixels is not None and self.image_processor is not None:
            self.image_processor = dataclasses.replace(self.image_processor, max_input_pixels=max_image_pixels)
        # What the engine (in this process, or stage 0's and every stage's) is given, either way.
        engine = dict(max_num_seqs=max_num_seqs, max_model_len=max_model_len, max_prefill_tokens=max_prefill_tokens,
                      tpot_target_ms=tpot_target_ms, prefix_cache=prefix_cache, speculative=speculative,
                      num_speculative_tokens=num_speculative_tokens, kv_cache_bytes=kv_cache_bytes,
                      max_num_tokens=max_num_tokens, kv_cache_dtype=kv_cache_dtype, quantized=quantized,
                      linear_precision=linear_precision)
        if processes:
            plan = process_plan(self.checkpoint, model if isinstance(model, str) else str(model.path), stages,
                                dev.type, dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch."),
                                tp=tp, dcp=dcp, pcp=pcp, launch=launch_options, **engine, **pipeline_options)
            self._restart = Restart(plan, self._new_driver, launcher=launch_options,
                                    auth_token=pipeline_options.get("auth_token"), rejoin=max_restarts > 0 and rejoin,
                                    log=_log)
            self._backend = self._restart.start()
            self.plan = self.driver.plan
            self._recover(max_restarts)
        else:
            self._backend = LocalBackend.load(self.checkpoint, dtype=self.dtype, device=dev, progress=load_progress,
                                              **engine)
        self.load_s = time.perf_counter() - start

    def _open(self, checkpoint: Checkpoint, device: torch.device, dtype: torch.dtype) -> None:
        self.checkpoint, self.config, self.device, self.dtype = checkpoint, checkpoint.config, device, dtype
        try:
            self.tokenizer = checkpoint.tokenizer()
        except FileNotFoundError:
            self.tokenizer = None  # token ids in and out only
        self.plan = self._backend = None
        self.last_stats: dict[str, Any] = {}
        self._ids = count()
        self.image_processor = None
        if self.config.vision_config is not None:
            from stagewise.frontend.image_processing import ImageProcessor

            self.image_processor = ImageProcessor.for_model(getattr(checkpoint, "path", None), self.config.vision_config)

    def _new_driver(self, plan, addresses, processes, keep_processes: bool, connect_timeout_s: float):
        from stagewise.pipeline.driver import PipelineDriver

        return PipelineDriver(plan, addresses, fingerprint=plan.fingerprint(self.checkpoint.hf_config),
                              auth_token=self._restart.auth_token, processes=processes,
                              connect_timeout_s=connect_timeout_s, keep_processes=keep_processes)

    def _recover(self, max_restarts: int) -> None:
        """The driver wrapped so that a broken pipeline is started again (``max_restarts`` > 0)."""
        if max_restarts:
            from stagewise.pipeline.recovery import Recovering

            self._backend = Recovering(self._backend, self._restart, max_restarts, log=_log)

    @property
    def driver(self):
        """The :class:`~stagewise.pipeline.driver.PipelineDriver` of the stages now running (None
        in one process, or once closed)."""
        backend = getattr(self, "_backend", None)
        if backend is None or isinstance(backend, LocalBackend):
            return None
        return getattr(backend, "driver", backend)

    @property
    def restarts(self) -> int:
        """How many times the stages were started again after a failure."""
        return getattr(getattr(self, "_backend", None), "restarts", 0)

    @classmethod
    def attach(cls, plan, *, addresses: Sequence[tuple[str, int]] | None = None,
               auth_token: str | None = None, store: tuple[str, int] | str | None = None,
               connect_timeout: float = 60.0, processes=None, max_restarts: int = 0,
               rejoin_timeout: float = REJOIN_S, launcher: dict | None = None) -> Pipeline:
        """Drive stage processes that are already running (``stagewise stage --plan PLAN --stage I``
        on their hosts, e.g. started by ``stagewise launch`` or torchrun): connect to each stage's
        listen address from the plan (its ``host`` when it listens on 0.0.0.0), or ``addresses``,
        or the addresses the stages published in torch.distributed's ``store`` (``(host, port)``
        or ``"host:port"``, torchrun's MASTER_ADDR:MASTER_PORT). ``connect_timeout``: how long to
        wait for a stage that does not accept yet. ``processes`` (a
        :class:`~stagewise.launch.local.StageProcesses`, e.g. of ssh clients) are watched and
        stopped with the pipeline. The model must be readable here too: the driver reads its
        config, tokenizer and chat template. ``max_restarts``: how many times a broken pipeline
        waits up to ``rejoin_timeout`` seconds for its stages to come back at their addresses
        (stages started with ``--rejoin`` wait for it; the lost ones are restarted on their hosts,
        e.g. by systemd or Kubernetes), its running requests resumed. ``launcher``: how ``processes``
        were started (:func:`~stagewise.launch.start.start_stages`' arguments, as ``stagewise launch
        --ssh`` gives them): the lost ones are started again that way instead of waited for."""
        from stagewise.launch.multihost import connect_address, load_plan
        from stagewise.parallel.runplan import RunPlan

        if not isinstance(plan, RunPlan):
            plan = load_plan(plan)
        if addresses is not None and store is not None:
            raise ValueError("Pipeline.attach: give addresses or store, not both")
        if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < 0:
            raise ValueError(f"Pipeline.attach: max_restarts must be an int >= 0, got {max_restarts!r}")
        if not rejoin_timeout > 0:
            raise ValueError(f"Pipeline.attach: rejoin_timeout must be > 0 seconds, got {rejoin_timeout!r}")
        if addresses is None and store is None:
            addresses = [connect_address(plan.stages[i], r) for i, r in plan.members]
            zero = sorted({i for (i, _), (_, port) in zip(plan.members, addresses) if port == 0})
            if zero:
                raise ValueError(f"Pipeline.attach: stages {zero} listen on port 0 in the plan; give their "
                                 "addresses or fixed ports")
        self = cls.__new__(cls)
        start = time.perf_counter()
        ckpt = open_checkpoint(plan.model)
        self._open(ckpt, torch.device(plan.stages[0].device), resolve_dtype(plan.dtype, ckpt.config.dtype))
        if store is not None:
            from stagewise.launch.torchrun import store_addresses

            addresses = store_addresses(plan, plan.fingerprint(ckpt.hf_config), store, timeout_s=connect_timeout)
        self.plan = plan
        self._restart = Restart(plan, self._new_driver, launcher=launcher, auth_token=auth_token,
                                rejoin=max_restarts > 0, rejoin_timeout_s=rejoin_timeout, log=_log)
        self._backend = self._restart.start(addresses, processes, connect_timeout)
        self._recover(max_restarts)
        self.load_s = time.perf_counter() - start
        return self

    def __enter__(self) -> Pipeline:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Drop the model and its KV cache, stop the stage processes (the object cannot generate
        afterwards)."""
        backend, self._backend = getattr(self, "_backend", None), None
        if backend is not None:
            backend.close()

    @sampling_keywords
    def generate(self, prompts: str | Sequence[str] | None = None, *,
                 prompt_token_ids: Sequence[int] | Sequence[Sequence[int]] | None = None, chat: bool = False,
                 overrides: Sequence[Mapping[str, Any] | None] | None = None,
                 on_text: Callable[[int, str], None] | None = None,
                 images: Sequence[Any] | None = None, **sampling: Any) -> list[Completion]:
        """One :class:`Completion` per prompt, in order. Argument errors raise ValueError before
        anything runs, as does a prompt whose tokens plus ``max_new_tokens`` exceed
        :attr:`max_model_len`; a prompt's own problem (empty, ids outside the vocabulary, out of KV
        blocks) gives that prompt finish_reason 'error'. ``on_text(i, delta)`` streams prompt i's
        text.

        The sampling keywords are the fields of :class:`~stagewise.engine.params.SamplingParams`,
        with its defaults: ``max_new_tokens``, ``temperature``, ``top_k``, ``top_p``,
        ``min_p``, the penalties, ``stop`` (a string or a list), ``stop_token_ids``, ``ignore_eos``
        (for benchmarks: every prompt gets max_new_tokens), and ``logprobs=K``, each generated
        token's log-probability and the K most likely tokens'
        (:class:`~stagewise.engine.params.TokenLogprobs`). With ``seed``, prompt i samples from
        seed + i. ``overrides[i]``, when given, holds sampling fields that replace the call's for
        prompt i.

        ``images[i]`` (one entry per prompt, None for none) holds prompt i's images: an image (a
        file path, a PIL image or a uint8 tensor ``[H, W, 3]``), a list of them, or the processor's
        output as :class:`~stagewise.engine.images.ImageInputs` or a dict of ``pixel_values`` and
        ``image_grid_thw``. Each run of image placeholder tokens in the prompt stands for the next
        image (a prompt with none gets them in front); with ``chat`` the template places them. An
        image that cannot be used gives that prompt finish_reason 'error' naming the image."""
        backend = self._backend
        if backend is None:
            raise ValueError("Pipeline.generate: the pipeline is closed")
        prepared, failed = prepare_prompt_images(images, self.image_processor)
        encoded = self._encode(prompts, prompt_token_ids, chat, [0 if p is None else p.num_images for p in prepared])
        if images is not None and len(images) != len(encoded):
            raise ValueError(f"Pipeline.generate: images must hold one entry per prompt ({len(encoded)}), "
                             f"got {len(images)}")
        failed.update(expand_prompts(encoded, prepared, self.config.vision_config, failed))
        params = sampling_per_prompt(sampling, len(encoded), overrides)  # every value checked before anything runs
        if (why := next(filter(None, (request_problem(p, self.checkpoint, self.tokenizer) for p in params)), None)):
            raise ValueError(f"Pipeline.generate: {why}")
        self.check_lengths(encoded, params)
        if self.driver is not None:
            from stagewise.pipeline.faults import PipelineBroken

            try:
                if self.broken:
                    raise PipelineBroken(self.broken)
                self._backend.stage_stats(reset=True)  # a pipeline broken meanwhile is repaired here
            except PipelineBroken as err:
                raise ValueError(f"Pipeline.generate: the pipeline is broken ({err}); create a new one") from None
        run = self.open_run(on_text=on_text)
        try:
            for i, (ids, p) in enumerate(zip(encoded, params)):
                if i in failed:
                    run.reject(i, list(ids), failed[i])
                else:
                    run.add(next(self._ids), i, list(ids), p, prepared[i] if prepared else None)
            run.wait()
        finally:
            run.cancel_unfinished()  # an interrupted call leaves nothing queued and no KV held
        self.last_stats = run.stats()
        if self.driver is not None and not self.broken:
            self.last_stats["stages"] = self.stage_stats()
        return [run.results[i] for i in range(len(encoded))]

    def open_run(self, *, on_text: Callable[[int, str], None] | None = None,
                 on_done: Callable[[int, Completion], None] | None = None) -> Run:
        """Requests on this pipeline outside :meth:`generate`, for a caller that keeps them coming
        (``stagewise serve``): add each with :meth:`new_request_id` as both its id and its index,
        then call the run's ``poll_once`` from that one thread. Its text and results come through
        ``on_text`` and ``on_done``."""
        if self._backend is None:
            raise ValueError("Pipeline.open_run: the pipeline is closed")
        return Run(self._backend, TextStreams(self.tokenizer, self.config.eos_token_ids), on_text, on_done)

    def new_request_id(self) -> int:
        return next(self._ids)

    @property
    def broken(self) -> str | None:
        """Why the stages stopped serving (a stage died or hung), or None while they serve."""
        return getattr(getattr(self, "_backend", None), "broken", None)

    @property
    def repairing(self) -> str | None:
        """Why the stages are being started again (a stage died or hung), or None; requests added
        meanwhile wait for the repaired pipeline."""
        return getattr(getattr(self, "_backend", None), "repairing", None)

    def stage_stats(self, *, trace: bool = False) -> list[dict[str, Any]]:
        """Each stage's measurements since the last generate() began: layers, busy_s and
        busy_fraction, send_s, recv_wait_s, steps, tokens, bytes_sent/received, rejected_frames,
        wall_s, the stage's ``host`` (and its Ray ``node_id`` when Ray placed it) and, with
        ``trace``, the timeline spans."""
        if self.driver is None:
            raise ValueError("Pipeline.stage_stats: stage statistics come from pipeline stages (stages > 1)")
        out = []
        for s in self._backend.stage_stats(trace=trace):  # a broken pipeline is repaired first, if it may be
            d = dataclasses.asdict(s)
            d["layers"] = list(s.layers)
            d["busy_fraction"] = s.busy_s / s.wall_s if s.wall_s > 0 else 0.0
            d["host"] = self.plan.stages[s.stage].host
            nodes = getattr(self.driver.processes, "nodes", None)  # placed by Ray: each rank's node
            if nodes:
                d["node_id"] = nodes[self.plan.members.index((s.stage, 0))]["node_id"]
            if not trace:
                d.pop("trace")
            out.append(d)
        return out

    def status(self) -> dict[str, int]:
        """``waiting`` (queue depth), ``running`` (active user rows), ``max_num_seqs``, and of the KV
        pool ``free_blocks`` (``cached_blocks`` of them the prefix cache keeps), ``total_blocks`` and
        ``evicted_blocks``; with stages, stage 0's latest report (every stage mirrors its pool)."""
        if self._backend is None:
            raise ValueError("Pipeline.status: the pipeline is closed")
        return dict(self.driver.status) if self.driver is not None else \
            dataclasses.asdict(self._backend.engine.status())

    def reset_prefix_cache(self) -> None:
        """Forget every cached prompt prefix: later requests compute theirs again (running ones go on)."""
        self._backend.reset_prefix_cache()

    def write_trace(self, path) -> None:
        """The stages' timeline of the last generate() call as a Chrome trace (Perfetto): one
        track per stage with compute, send and receive-wait spans."""
        if self.driver is None:
            raise ValueError("Pipeline.write_trace: traces come from pipeline stages (stages > 1)")
        from stagewise.trace import write_stage_trace

        write_stage_trace(path, self.stage_stats(trace=True), self.plan)

    @property
    def max_num_seqs(self) -> int:
        """The most requests running at once (more wait in the scheduler's queue)."""
        if self.plan is not None:
            return self.plan.max_num_seqs
        return self._backend.engine.status().max_num_seqs

    @property
    def max_model_len(self) -> int:
        """The most tokens (prompt + generated) one request may hold."""
        if self.plan is not None:
            return self.plan.max_model_len or self.config.max_position_embeddings
        return self._backend.engine.max_model_len

    def check_lengths(self, encoded: list[list[int]], params: list) -> None:
        """Every prompt whose tokens plus max_new_tokens exceed max_model_len, named at once
        (an error rather than a silent clamp: the caller asked for tokens the model cannot hold)."""
        check_lengths(encoded, params, self.max_model_len)

    def _encode(self, prompts, prompt_token_ids, chat: bool, image_counts: list[int] | None = None) -> list[list[int]]:
        return encode_prompts(self.tokenizer, prompts, prompt_token_ids, chat=chat, render=self.render_chat,
                              image_counts=image_counts or None)

    def render_chat(self, messages: list[dict[str, Any]], tools: list[dict] | None = None) -> str:
        """The checkpoint's chat template applied to ``messages`` (and ``tools``), the assistant turn opened."""
        return render_chat(self.checkpoint, self.tokenizer, messages, tools)
