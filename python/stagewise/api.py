"""The public Python API: :class:`Pipeline` loads a model and generates, :class:`Completion` is
one prompt's result.

    with stagewise.Pipeline("smollm2-135m") as pipe:
        [c] = pipe.generate(["What is the capital of France?"], chat=True, max_new_tokens=20)
        print(c.text, c.finish_reason)
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import count
from typing import Any

import torch

from stagewise.model.checkpoint import Checkpoint, open_checkpoint
from stagewise.model.quant import check_precision
from stagewise.model.stage import StageModel
from stagewise.model.weights import DTYPES, load_stage_weights
from stagewise.runtime.engine import Engine, RequestOutput
from stagewise.runtime.sampling import SamplingParams
from stagewise.transport import select

FINISH_REASONS = ("stop", "length", "cancelled", "error")


@dataclass(kw_only=True, slots=True)
class Completion:
    """The result of one prompt."""

    text: str
    """Generated text (stop strings and stop tokens not included)."""
    token_ids: list[int]
    """Generated token ids only (a stop token that ended generation included)."""
    finish_reason: str
    """'stop' (EOS, stop token or stop string), 'length', 'cancelled' or 'error'."""
    error: str | None = None
    """What went wrong when finish_reason is 'error'."""
    prompt_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.finish_reason not in FINISH_REASONS:
            raise ValueError(f"Completion.finish_reason: expected one of {FINISH_REASONS}, got {self.finish_reason!r}")


class Pipeline:
    """A model loaded for generation. ``stages=1`` runs every layer in this process."""

    def __init__(self, model: str | Checkpoint, *, stages: int = 1, device: str = "cpu", dtype: str = "auto",
                 max_num_seqs: int = 32, max_model_len: int | None = None, kv_cache_bytes: int | None = None,
                 max_num_tokens: int | None = None, load_progress: Callable[[int, int, int], None] | None = None,
                 quantized: bool | None = None, linear_precision: str = "exact",
                 **parallel_options: Any) -> None:
        """``load_progress(done, total, nbytes)`` follows the weight reading (see load_stage_weights).

        ``quantized``: whether block-quantised GGUF matrices stay in their blocks (run by
        ``stagewise.ops.quant_linear`` with their exact values); None (the default) keeps them when
        the stage computes in float32, which ``dtype="auto"`` is for a quantised GGUF. See
        :func:`stagewise.model.weights.load_stage_weights`.

        ``linear_precision``: ``"exact"`` (default) or ``"int8"``, an approximate CPU mode in which
        those blocks multiply with the activations quantised to int8 per block of 32, as llama.cpp
        does on the CPU (:func:`stagewise.ops.quant_linear_int8`): faster decode, tokens that may
        differ from the exact model's."""
        check_precision("Pipeline", linear_precision)
        if isinstance(stages, bool) or not isinstance(stages, int) or stages < 1:
            raise ValueError(f"Pipeline: stages must be an int >= 1, got {stages!r}")
        pipeline_options = {k: parallel_options.pop(k) for k in PIPELINE_OPTIONS if k in parallel_options}
        if parallel_options:
            raise ValueError(f"Pipeline: unknown options {sorted(parallel_options)}; expected some of "
                             f"{sorted(PIPELINE_OPTIONS)}")
        if stages == 1 and pipeline_options:
            raise ValueError(f"Pipeline: {sorted(pipeline_options)} apply to stages > 1, got stages=1")
        if isinstance(max_num_seqs, bool) or not isinstance(max_num_seqs, int) or max_num_seqs < 1:
            raise ValueError(f"Pipeline: max_num_seqs must be an int >= 1, got {max_num_seqs!r}")
        dev = _device(device)
        if linear_precision == "int8" and dev.type != "cpu":
            raise NotImplementedError(f"Pipeline: linear_precision='int8' runs on the CPU only, got device={device!r}")
        start = time.perf_counter()
        ckpt = open_checkpoint(model)
        cfg = ckpt.config
        torch_dtype = _dtype(dtype, cfg.dtype)
        self.engine = self.driver = None
        self.last_stats: dict[str, Any] = {}
        self._ids = count()
        if stages > 1:
            self.checkpoint, self.config, self.device, self.dtype = ckpt, cfg, dev, torch_dtype
            self.tokenizer = _tokenizer(ckpt)
            self._start_pipeline(model, stages, dev, dtype, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                                 kv_cache_bytes=kv_cache_bytes, max_num_tokens=max_num_tokens, quantized=quantized,
                                 linear_precision=linear_precision,
                                 **pipeline_options)
            self.load_s = time.perf_counter() - start
            return
        weights = load_stage_weights(ckpt, 0, cfg.num_layers, dtype=torch_dtype, quantized=quantized,
                                     linear_precision=linear_precision,
                                     progress=load_progress)
        stage = StageModel.from_weights(cfg, 0, cfg.num_layers, weights, dtype=torch_dtype, device=dev)
        del weights
        tokenizer = _tokenizer(ckpt)
        self.checkpoint, self.config, self.tokenizer = ckpt, cfg, tokenizer
        self.device, self.dtype = dev, torch_dtype
        self.engine = Engine(stage, tokenizer=tokenizer, device=dev, max_num_seqs=max_num_seqs,
                             max_model_len=max_model_len, kv_cache_bytes=kv_cache_bytes,
                             max_num_tokens=max_num_tokens)
        self.load_s = time.perf_counter() - start

    def _start_pipeline(self, model, stages: int, dev: torch.device, dtype: str, *, partition="even",
                        transport: str = "auto", checksum: bool = True, auth_token: str | None = None,
                        threads: int | None = None, **limits: Any) -> None:
        """Spawn one process per stage on this machine and connect to them."""
        import os

        from stagewise.launch.local import spawn_stages
        from stagewise.launch.planfile import RunPlan
        from stagewise.parallel.plan import decode_layer_costs

        cfg = self.config
        if not isinstance(model, str):
            model = str(model.path)
        if dev.type == "cuda":
            count_ = torch.cuda.device_count()
            devices = [f"cuda:{i % count_}" for i in range(stages)]
        else:
            devices = ["cpu"] * stages
        threads = threads or max(1, (os.cpu_count() or 1) // stages)
        plan = RunPlan.build(model, cfg.num_layers, stages, partition,
                             costs=decode_layer_costs(cfg) if partition == "balanced" else None, devices=devices,
                             dtype=dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch."),
                             transport=transport, checksum=checksum, **limits)
        from dataclasses import replace

        plan = replace(plan, stages=tuple(replace(s, threads=threads) for s in plan.stages))
        procs, addresses, _ = spawn_stages(plan, auth_token=auth_token)
        self._connect(plan, addresses, auth_token=auth_token, processes=procs)

    def _connect(self, plan, addresses, *, auth_token: str | None, processes=None,
                 connect_timeout_s: float = 60.0) -> None:
        from stagewise.runtime.driver import PipelineDriver

        self.plan = plan
        self.driver = PipelineDriver(plan, addresses, fingerprint=plan.fingerprint(self.checkpoint.hf_config),
                                     auth_token=auth_token, processes=processes,
                                     hop_transports=hop_transports(plan),
                                     connect_timeout_s=connect_timeout_s)

    @classmethod
    def attach(cls, plan, *, addresses: Sequence[tuple[str, int]] | None = None,
               auth_token: str | None = None, store: tuple[str, int] | str | None = None,
               connect_timeout: float = 60.0, processes: Sequence | None = None) -> Pipeline:
        """Drive stage processes that are already running (``stagewise stage --plan PLAN --stage I``
        on their hosts, e.g. started by ``stagewise launch`` or torchrun): connect to each stage's
        listen address from the plan (its ``host`` when it listens on 0.0.0.0), or ``addresses``,
        or the addresses the stages published in torch.distributed's ``store`` (``(host, port)``
        or ``"host:port"``, torchrun's MASTER_ADDR:MASTER_PORT). ``connect_timeout``: how long to
        wait for a stage that does not accept yet. ``processes`` (Popen-like, one per stage, e.g.
        ssh clients) are watched and stopped with the pipeline. The model must be readable here
        too: the driver reads its config, tokenizer and chat template."""
        from stagewise.launch.multihost import connect_address, load_plan
        from stagewise.launch.planfile import RunPlan

        if not isinstance(plan, RunPlan):
            plan = load_plan(plan)
        if addresses is not None and store is not None:
            raise ValueError("Pipeline.attach: give addresses or store, not both")
        if addresses is None and store is None:
            addresses = [connect_address(s) for s in plan.stages]
            zero = [s.index for s, (_, port) in zip(plan.stages, addresses) if port == 0]
            if zero:
                raise ValueError(f"Pipeline.attach: stages {zero} listen on port 0 in the plan; give their "
                                 "addresses or fixed ports")
        self = cls.__new__(cls)
        start = time.perf_counter()
        ckpt = open_checkpoint(plan.model)
        self.checkpoint, self.config = ckpt, ckpt.config
        self.device = torch.device(plan.stages[0].device)
        self.dtype = _dtype(plan.dtype, ckpt.config.dtype)
        self.tokenizer = _tokenizer(ckpt)
        self.engine = self.driver = None
        self.last_stats, self._ids = {}, count()
        if store is not None:
            from stagewise.launch.torchrun import store_addresses

            addresses = store_addresses(plan, plan.fingerprint(ckpt.hf_config), store, timeout_s=connect_timeout)
        self._connect(plan, list(addresses), auth_token=auth_token,
                      processes=None if processes is None else list(processes), connect_timeout_s=connect_timeout)
        self.load_s = time.perf_counter() - start
        return self

    def __enter__(self) -> Pipeline:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Drop the model and its KV cache, stop the stage processes (the object cannot generate
        afterwards)."""
        self.engine = None
        if self.driver is not None:
            driver, self.driver = self.driver, None
            driver.close()

    def generate(self, prompts: str | Sequence[str] | None = None, *,
                 prompt_token_ids: Sequence[int] | Sequence[Sequence[int]] | None = None,
                 max_new_tokens: int = 64, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                 seed: int | None = None, stop: str | Sequence[str] | None = None, chat: bool = False,
                 ignore_eos: bool = False, on_text: Callable[[int, str], None] | None = None) -> list[Completion]:
        """One :class:`Completion` per prompt, in order. Argument errors raise ValueError before
        anything runs; a prompt's own problem (empty, ids outside the vocabulary, longer than
        max_model_len, out of KV blocks) gives that prompt finish_reason 'error'. With ``seed``,
        prompt i samples from seed + i. ``on_text(i, delta)`` streams prompt i's text. ``ignore_eos``
        generates past the model's EOS ids (for benchmarks: every prompt gets max_new_tokens)."""
        if self.engine is None and self.driver is None:
            raise ValueError("Pipeline.generate: the pipeline is closed")
        stop = [stop] if isinstance(stop, str) else list(stop or [])
        # Checks every sampling value (ValueError) before anything runs.
        SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                       seed=seed, stop=stop, ignore_eos=ignore_eos)
        encoded = self._encode(prompts, prompt_token_ids, chat)
        if stop and self.tokenizer is None:
            raise ValueError("Pipeline.generate: stop strings need a tokenizer; this checkpoint has none")
        if self.driver is not None:
            return self._generate_pipeline(encoded, on_text, max_new_tokens=max_new_tokens, temperature=temperature,
                                           top_k=top_k, top_p=top_p, seed=seed, stop=stop, ignore_eos=ignore_eos)
        engine, start = self.engine, time.perf_counter()
        prefill0, decode0 = engine.num_prefill_tokens, engine.num_decode_tokens
        results: dict[int, Completion] = {}
        rids: dict[int, int] = {}
        try:
            for i, ids in enumerate(encoded):
                params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                                        top_p=top_p, seed=None if seed is None else (seed + i) % 2**64, stop=stop,
                                        ignore_eos=ignore_eos)
                rid = next(self._ids)
                callback = None if on_text is None else (lambda _rid, text, i=i: on_text(i, text))
                try:
                    engine.add_request(rid, ids, params, callback)
                except ValueError as err:
                    results[i] = Completion(text="", token_ids=[], finish_reason="error", error=str(err),
                                            prompt_token_ids=list(ids))
                    continue
                rids[rid] = i
            outputs: list[RequestOutput] = []
            while engine.has_unfinished():
                outputs += engine.step()
        finally:
            for rid in rids:  # an interrupted call leaves nothing queued and no KV held
                engine.cancel(rid)
        for out in outputs:
            results[rids[out.request_id]] = Completion(text=out.text, token_ids=out.token_ids,
                                                       finish_reason=out.finish_reason, error=out.error,
                                                       prompt_token_ids=out.prompt_ids)
        self.last_stats = _stats(outputs, start, engine.num_prefill_tokens - prefill0,
                                 engine.num_decode_tokens - decode0)
        return [results[i] for i in range(len(encoded))]

    def _generate_pipeline(self, encoded: list[list[int]], on_text, *, seed, **sampling) -> list[Completion]:
        """generate() over the stage processes: requests go to stage 0, results come back."""
        import dataclasses

        driver, start = self.driver, time.perf_counter()
        if driver.broken:
            raise ValueError(f"Pipeline.generate: the pipeline is broken ({driver.broken}); create a new one")
        driver.stage_stats(reset=True)
        index: dict[int, int] = {}
        results: dict[int, Completion] = {}
        try:
            for i, ids in enumerate(encoded):
                params = SamplingParams(seed=None if seed is None else (seed + i) % 2**64, **sampling)
                rid = next(self._ids)
                index[rid] = i
                driver.add(rid, list(ids), dataclasses.asdict(params))
            callback = None if on_text is None else (lambda rid, text: on_text(index[rid], text))
            outputs = []
            while len(outputs) < len(encoded):
                for out in driver.pump(0.05, callback):
                    outputs.append(out)
        except BaseException:
            for rid in index:
                try:
                    driver.cancel(rid)
                except Exception:  # noqa: BLE001 - broken pipeline: nothing left to cancel
                    pass
            raise
        for out in outputs:
            i = index[out["id"]]
            results[i] = Completion(text=out["text"], token_ids=out["token_ids"], finish_reason=out["finish_reason"],
                                    error=out["error"], prompt_token_ids=list(encoded[i]))
        end = time.perf_counter()
        firsts = [o["first_token_s"] for o in outputs if o.get("first_token_s") is not None]
        first = min(firsts, default=end)
        decode_tokens = sum(max(len(c.token_ids) - 1, 0) for c in results.values())
        stats = {"wall_s": end - start, "prefill_tokens": sum(len(e) for e in encoded), "decode_tokens": decode_tokens,
                 "ttft_s": first - start, "mean_ttft_s": sum(f - start for f in firsts) / len(firsts) if firsts else 0.0,
                 "decode_s": end - first,
                 "decode_tokens_per_s": decode_tokens / (end - first) if decode_tokens and end > first else 0.0}
        if not driver.broken:
            stages = driver.stage_stats()
            for s in stages:
                s["busy_fraction"] = s["busy_s"] / s["wall_s"] if s["wall_s"] > 0 else 0.0
            stats["stages"] = stages
        self.last_stats = stats
        return [results[i] for i in range(len(encoded))]

    def status(self) -> dict[str, int]:
        """Seed 002's status: ``waiting`` (queue depth), ``running`` (active user rows),
        ``max_num_seqs``, ``free_blocks`` and ``total_blocks`` of the KV pool (stage 0's, which
        every stage mirrors). With stages, the latest report of stage 0."""
        if self.engine is not None:
            st = self.engine.status()
            return {"waiting": st.waiting, "running": st.running, "max_num_seqs": st.max_num_seqs,
                    "free_blocks": st.free_blocks, "total_blocks": st.total_blocks}
        if self.driver is None:
            raise ValueError("Pipeline.status: the pipeline is closed")
        return dict(self.driver.status)

    def write_trace(self, path) -> None:
        """The stages' timeline of the last generate() call as a Chrome trace (Perfetto): one
        track per stage with compute, send and receive-wait spans."""
        if self.driver is None:
            raise ValueError("Pipeline.write_trace: traces come from pipeline stages (stages > 1)")
        from stagewise.trace import TraceEvent, write_chrome_trace

        stages = self.driver.stage_stats(trace=True)
        spans = [(s["stage"], *e) for s in stages for e in s.get("trace", [])]
        t0 = min((start for _, _, start, _, _ in spans), default=0.0)
        kinds = {"compute": "compute", "send": "comm", "recv-wait": "bubble"}
        events = [TraceEvent(stage, f"{name} mb{mb}" if mb >= 0 else name, kinds[name], start - t0, dur,
                             {"microbatch": mb}) for stage, name, start, dur, mb in spans]
        write_chrome_trace(path, events, num_stages=len(stages), process="measured",
                           other={"model": self.plan.model, "layers": str(self.plan.stage_plan),
                                  "transport": self.plan.transport})

    def _encode(self, prompts, prompt_token_ids, chat: bool) -> list[list[int]]:
        if (prompts is None) == (prompt_token_ids is None):
            raise ValueError("Pipeline.generate: give exactly one of prompts and prompt_token_ids")
        if prompt_token_ids is not None:
            if chat:
                raise ValueError("Pipeline.generate: chat=True needs text prompts, not prompt_token_ids")
            ids = list(prompt_token_ids)
            if ids and all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                ids = [ids]  # one prompt given as a flat list
            if not all(isinstance(p, (list, tuple)) for p in ids):
                raise ValueError("Pipeline.generate: prompt_token_ids must be a list of ints or a list of "
                                 f"lists of ints, got {prompt_token_ids!r:.200}")
            return [list(p) for p in ids]
        texts = [prompts] if isinstance(prompts, str) else list(prompts)
        if not all(isinstance(p, str) for p in texts):
            raise ValueError(f"Pipeline.generate: prompts must be a string or a list of strings, got {prompts!r:.200}")
        if self.tokenizer is None:
            raise ValueError("Pipeline.generate: this checkpoint has no tokenizer; pass prompt_token_ids")
        if chat:
            texts = [self.render_chat([{"role": "user", "content": t}]) for t in texts]
        # A chat template writes the special tokens itself (as transformers' apply_chat_template assumes).
        return [self.tokenizer.encode(t, add_special_tokens=not chat).ids for t in texts]

    def render_chat(self, messages: list[dict[str, str]]) -> str:
        """The checkpoint's chat template applied to ``messages``, with the assistant turn opened."""
        template = self.checkpoint.chat_template
        if not template:
            raise ValueError(f"Pipeline: checkpoint {str(self.checkpoint.path)!r} has no chat template; "
                             "use chat=False")
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str):
            raise TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals.update(raise_exception=raise_exception,
                           strftime_now=lambda fmt: time.strftime(fmt))
        special = {}
        for name, token_id in (("bos_token", self.config.bos_token_id),
                               ("eos_token", self.config.eos_token_ids[0] if self.config.eos_token_ids else None)):
            if token_id is not None:
                special[name] = self.tokenizer.id_to_token(token_id) or ""
        return env.from_string(template).render(messages=messages, add_generation_prompt=True, **special)


PIPELINE_OPTIONS = ("partition", "transport", "checksum", "auth_token", "threads")


def _tokenizer(ckpt: Checkpoint):
    try:
        return ckpt.tokenizer()
    except FileNotFoundError:
        return None  # token ids in and out only


def hop_transports(plan) -> list[str]:
    """The transport of each stage's outgoing hop (stage i -> i + 1, the last -> 0), by the one
    rule of :func:`stagewise.transport.select.resolve`: ``auto`` is shm between two stages of one
    host (the same ``host`` in the plan; every locally spawned stage), tcp between hosts."""
    n = plan.num_stages
    hops = []
    for i in range(n):
        a, b = plan.stages[i], plan.stages[(i + 1) % n]
        try:
            hops.append(select.resolve(plan.transport, same_host=a.host == b.host,
                                       cuda=a.device.startswith("cuda") and b.device.startswith("cuda")))
        except ValueError as e:
            raise ValueError(f"Pipeline: hop stage {a.index} -> {b.index}: {e}") from None
    return hops


def _device(device: str | torch.device) -> torch.device:
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"Pipeline: device must be 'cpu' or 'cuda[:N]', got {device!r}") from None
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"Pipeline: device must be 'cpu' or 'cuda[:N]', got {device!r}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("Pipeline: device 'cuda' was asked for but no CUDA device is available")
    return dev


def _dtype(dtype: str | torch.dtype, stated: torch.dtype | None) -> torch.dtype:
    if dtype == "auto":
        return stated if stated in DTYPES.values() else torch.float32
    if isinstance(dtype, str):
        dtype = DTYPES.get(dtype.removeprefix("torch."), dtype)
    if dtype not in DTYPES.values():
        raise ValueError(f"Pipeline: dtype must be 'auto', 'float32', 'bfloat16' or 'float16', got {dtype!r}")
    return dtype


def _stats(outputs: list[RequestOutput], start: float, prefill_tokens: int, decode_tokens: int) -> dict:
    """Timings of one generate call; decode time runs from the first token to the end."""
    end = time.perf_counter()
    firsts = [o.first_token_s for o in outputs if o.first_token_s is not None]
    first = min(firsts, default=end)
    decode_s = end - first
    return {
        "wall_s": end - start,
        "prefill_tokens": prefill_tokens,
        "decode_tokens": decode_tokens,
        "ttft_s": first - start,
        "mean_ttft_s": sum(f - start for f in firsts) / len(firsts) if firsts else 0.0,
        "decode_s": decode_s,
        "decode_tokens_per_s": decode_tokens / decode_s if decode_tokens and decode_s > 0 else 0.0,
    }
