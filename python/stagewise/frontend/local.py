"""The engine in this process as a :class:`~stagewise.frontend.run.Backend`: every layer here, no
stage processes (``Pipeline(..., stages=1)``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from stagewise.engine.params import SamplingParams, TokenLogprobs
from stagewise.engine.requests import RequestOutput

if TYPE_CHECKING:
    from stagewise.engine.engine import Engine
    from stagewise.engine.images import ImageInputs


class LocalBackend:
    """The single-process backend: one engine over every layer. As with the driver, every request
    added ends with exactly one output from :meth:`poll`, a cancelled or aborted one included."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._ended: list[RequestOutput] = []

    @classmethod
    def load(cls, checkpoint, *, dtype, device, quantized: bool | None, linear_precision: str, progress,
             tpot_target_ms: float | None, speculative: str | None, num_speculative_tokens: int,
             **engine: Any) -> LocalBackend:
        """Every layer of ``checkpoint`` loaded here under one engine (``engine``: the rest of
        :meth:`Engine.for_model`'s options)."""
        from stagewise.engine.engine import Engine
        from stagewise.engine.speculative import SpeculativeConfig
        from stagewise.model.stage import load_stage

        stage = load_stage(checkpoint, 0, checkpoint.config.num_layers, dtype=dtype, device=device,
                           quantized=quantized, linear_precision=linear_precision, progress=progress)
        return cls(Engine.for_model(stage, device=device, tpot_target_s=None if tpot_target_ms is None
                                    else tpot_target_ms / 1e3,
                                    speculative=SpeculativeConfig.of(speculative, num_speculative_tokens), **engine))

    def add(self, request_id: int, prompt_ids: list[int], params: SamplingParams,
            images: ImageInputs | None = None) -> None:
        self.engine.add_request(request_id, prompt_ids, params, images)

    def cancel(self, request_id: int) -> None:
        out = self.engine.cancel(request_id)
        if out is not None:
            self._ended.append(out)

    def abort(self, request_id: int, error: str) -> None:
        out = self.engine.abort(request_id, error)
        if out is not None:
            self._ended.append(out)

    def poll(self, timeout: float) -> list[RequestOutput]:
        ended, self._ended = self._ended, []
        return ended + self.engine.step()

    @property
    def constraint_s(self) -> float:
        """Seconds the engine's steps spent on structured output (the executor's count)."""
        return self.engine.executor.constraint_s

    def set_step_threads(self, one_token: int, more: int) -> None:
        """Run a step of one token (a lone request's decode) on ``one_token`` torch threads and a
        larger step on ``more``, instead of the process's setting."""
        self.engine.executor.threads_by_tokens = (one_token, more)

    def take_tokens(self) -> list[tuple[int, int, TokenLogprobs | None]]:
        return self.engine.take_tokens()

    def reset_prefix_cache(self) -> None:
        self.engine.reset_prefix_cache()

    def close(self) -> None:
        self.engine = None
