"""The OpenAI-compatible HTTP server in front of a :class:`~stagewise.api.Pipeline` (a Starlette
app; ``stagewise serve`` runs it on uvicorn).

- ``POST /v1/completions`` and ``POST /v1/chat/completions``: whole answers, or server-sent events
  with ``"stream": true`` (``data: {chunk}`` lines, then ``data: [DONE]``).
- ``GET /v1/models``, ``GET /health`` (200 while requests can be served, 503 once the pipeline
  failed or the server is stopping), ``GET /metrics`` (Prometheus).

Every request joins the pipeline's running batches through the one :class:`ServeLoop`. A client that
disconnects cancels its request (its KV is freed on every stage). Past the loop's capacity a
request gets 503 with ``Retry-After``; a bad one 400 with OpenAI's error body, and nothing else is
disturbed. With an API key, ``/v1/*`` needs ``Authorization: Bearer <key>`` (401 otherwise).

A body over ``max_request_bytes`` gets 413 before it is read (by its Content-Length) or as soon as
its streamed bytes pass the limit. The JSON, the chat template and the tokenizer run on worker
threads, neither on the event loop nor on the serving loop's thread: a prompt of megabytes takes
seconds to tokenise, and every other client's tokens and probes go on meanwhile.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hmac
import json
import secrets
import time
from contextlib import asynccontextmanager

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from stagewise.engine.requests import prompt_problem
from stagewise.frontend.prompts import render_chat
from stagewise.frontend.run import Completion
from stagewise.frontend.text import request_problem, warm_constraints
from stagewise.serve import openai
from stagewise.serve.loop import Busy, ServeLoop, Sink, Unavailable
from stagewise.serve.media import MediaLimits, read_image_url
from stagewise.serve.metrics import ServerMetrics
from stagewise.serve.reasoning import ReasoningStream, split
from stagewise.serve.tool_stream import ToolStream

RETRY_AFTER_S = 1


def _error(err: openai.ApiError, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=headers)


class _Stream:
    """One request's events, moved from the loop's thread onto the server's event loop."""

    def __init__(self) -> None:
        self.aloop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()

    def sink(self) -> Sink:
        put = self.queue.put_nowait
        return Sink(on_text=lambda text, lps: self.aloop.call_soon_threadsafe(put, ("text", text, lps)),
                    on_done=lambda result, timings: self.aloop.call_soon_threadsafe(put, ("done", result, timings)))


def build_app(pipe, *, model_name: str, api_key: str | None = None, max_waiting: int = 64,
              default_max_tokens: int = 256, media: MediaLimits | None = None,
              max_request_bytes: int = openai.MAX_REQUEST_BYTES, chat_template: str | None = None,
              reasoning_parser: str | None = None, step_threads: tuple[int, int] | None = None) -> Starlette:
    """The server's app over ``pipe`` (which the caller keeps and closes after the app stopped);
    ``media``: how a chat's image URLs are read (default :class:`MediaLimits`); a request body over
    ``max_request_bytes`` is refused (413); ``chat_template``: the template chats are rendered with
    (default: the checkpoint's); ``reasoning_parser``: see :mod:`stagewise.serve.reasoning`;
    ``step_threads``: see :class:`~stagewise.serve.loop.ServeLoop`."""
    if isinstance(max_request_bytes, bool) or not isinstance(max_request_bytes, int) or max_request_bytes < 1:
        raise ValueError(f"build_app: max_request_bytes must be a positive integer, got {max_request_bytes!r}")
    media = media or MediaLimits()
    # The images' reading and decoding: threads of their own, so that slow fetches never hold the
    # default executor (/metrics, shutdown).
    images_pool = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="images")
    metrics = ServerMetrics(model_name)
    state: dict = {"loop": None}

    def piece(token: int) -> str:
        return pipe.tokenizer.decode([token]) if pipe.tokenizer is not None else str(token)

    template = chat_template or getattr(pipe.checkpoint, "chat_template", None)

    def render(messages, tools=None, template_kwargs=None):
        from jinja2 import TemplateError

        if pipe.tokenizer is None:
            raise ValueError("this checkpoint has no tokenizer")
        try:
            return render_chat(pipe.checkpoint, pipe.tokenizer, messages, tools, template=template,
                               template_kwargs=template_kwargs)
        except TemplateError as err:
            raise ValueError(str(err)) from None

    @asynccontextmanager
    async def lifespan(app):
        state["loop"] = ServeLoop(pipe, max_waiting=max_waiting, observe=metrics.observe, step_threads=step_threads)
        # The constraints' vocabulary, built while the server waits for its first request.
        asyncio.get_running_loop().run_in_executor(None, warm_constraints, pipe.checkpoint, pipe.tokenizer)
        try:
            yield
        finally:
            await asyncio.get_running_loop().run_in_executor(None, state["loop"].close)
            images_pool.shutdown(wait=False, cancel_futures=True)

    def authorised(request: Request) -> bool:
        if api_key is None:
            return True
        got = request.headers.get("authorization", "")
        return got.startswith("Bearer ") and hmac.compare_digest(got[7:].encode(), api_key.encode())

    def unauthorised() -> JSONResponse:
        metrics.reject("unauthorized")
        return _error(openai.ApiError("a valid API key is needed: Authorization: Bearer <key>", status=401,
                                      type="authentication_error", code="invalid_api_key"))

    def prepare(raw: bytes, chat: bool) -> tuple[openai.ApiRequest, list[int]]:
        """The request and its prompt's token ids (on a worker thread: see the module's docstring)."""
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise openai.ApiError(f"the request body is not valid JSON: {err}") from None
        if chat:
            req = openai.parse_chat(body, model_name, render, default_max_tokens,
                                    vision=pipe.image_processor is not None, template=template,
                                    reasoning_parser=reasoning_parser)
        else:
            req = openai.parse_completion(body, model_name, default_max_tokens)
        ids = req.prompt_ids if req.prompt_ids is not None else _encode(pipe, req.prompt, req.chat)
        if not req.images:  # else checked once the images have grown their placeholders
            _check_prompt(pipe, ids, req)
        return req, ids

    async def generate(request: Request, chat: bool) -> Response:
        if not authorised(request):
            return unauthorised()
        loop: ServeLoop = state["loop"]
        try:
            req, ids = await run_in_threadpool(prepare, await _read_body(request, max_request_bytes), chat)
            images = None
            if req.images:  # fetched, decoded and cut into patches off the event loop, if there is room
                if len(req.images) > media.max_images:
                    where = req.images[media.max_images][0]
                    raise openai.ApiError(f"{where}: at most {media.max_images} images a request", param=where)
                if loop.held >= loop.capacity:
                    raise Busy(f"{loop.held} requests are running or waiting (at most {loop.capacity})")
                images, ids = await asyncio.get_running_loop().run_in_executor(images_pool, _prompt_images, pipe,
                                                                               req, ids, media)
        except openai.ApiError as err:
            metrics.reject("too_large" if err.status == 413 else "bad_request")
            return _error(err)
        except Busy as err:
            metrics.reject("busy")
            return _error(openai.ApiError(f"the server is busy: {err}; retry later", status=503,
                                          type="server_error", code="busy"), {"Retry-After": str(RETRY_AFTER_S)})
        stream = _Stream()
        try:
            rid = loop.submit(ids, req.params, stream.sink(), images)
        except Busy as err:
            metrics.reject("busy")
            return _error(openai.ApiError(f"the server is busy: {err}; retry later", status=503,
                                          type="server_error", code="busy"), {"Retry-After": str(RETRY_AFTER_S)})
        except Unavailable as err:
            metrics.reject("unavailable")
            return _error(openai.ApiError(str(err), status=503, type="server_error", code="unavailable"))
        name = f"{'chatcmpl' if chat else 'cmpl'}-{secrets.token_hex(12)}"
        if req.stream:
            return StreamingResponse(_events(loop, rid, stream, req, name, model_name, piece, len(ids)),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        return await _whole(request, loop, rid, stream, req, name, model_name, piece)

    async def completions(request: Request) -> Response:
        return await generate(request, chat=False)

    async def chat_completions(request: Request) -> Response:
        return await generate(request, chat=True)

    async def models(request: Request) -> Response:
        if not authorised(request):
            return unauthorised()
        return JSONResponse({"object": "list", "data": [
            {"id": model_name, "object": "model", "created": started, "owned_by": "stagewise",
             "max_model_len": pipe.max_model_len}]})

    async def reset_prefix_cache(request: Request) -> Response:
        """Every cached prompt prefix forgotten (vLLM's admin call of the same name): later requests
        compute theirs again; running ones go on."""
        if not authorised(request):
            return unauthorised()
        state["loop"].reset_prefix_cache()
        return JSONResponse({"status": "ok"})

    async def health(request: Request) -> Response:
        loop = state["loop"]
        status, why = ("starting", "the server is starting") if loop is None else loop.health()
        if why:
            return JSONResponse({"status": status, "reason": why}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def metrics_text(request: Request) -> Response:
        loop: ServeLoop = state["loop"]
        stages = await asyncio.get_running_loop().run_in_executor(None, loop.stage_stats)
        num_stages = 1 if pipe.plan is None else pipe.plan.num_stages
        return PlainTextResponse(metrics.scrape(loop.status, num_stages, stages, pipe.restarts),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    started = int(time.time())
    routes = [Route("/v1/completions", completions, methods=["POST"]),
              Route("/v1/chat/completions", chat_completions, methods=["POST"]),
              Route("/v1/models", models, methods=["GET"]),
              Route("/v1/reset_prefix_cache", reset_prefix_cache, methods=["POST"]),
              Route("/health", health, methods=["GET"]),
              Route("/metrics", metrics_text, methods=["GET"])]
    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.metrics = metrics
    app.state.serving = state
    return app


async def _read_body(request: Request, limit: int) -> bytes:
    """The request's body; ApiError 413 when it is over ``limit`` bytes, told by its Content-Length
    before anything is read, else as soon as the bytes streamed in pass the limit."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(f"{int(declared)} bytes", limit)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise _too_large(f"more than {limit} bytes", limit)
    return bytes(body)


def _too_large(size: str, limit: int) -> openai.ApiError:
    return openai.ApiError(f"the request body holds {size}; this server takes at most {limit} bytes "
                           "(stagewise serve --max-request-bytes)", status=413, code="request_too_large")


def _encode(pipe, text: str, chat: bool) -> list[int]:
    if pipe.tokenizer is None:
        raise openai.ApiError("this checkpoint has no tokenizer: send 'prompt' as a list of token ids",
                              param="prompt")
    # A chat template writes the special tokens itself (as Pipeline.generate(chat=True) encodes it).
    # encode_batch, unlike encode, lets go of the GIL while it works: the event loop and the
    # serving loop's thread run meanwhile (a 5 MB prompt takes seconds).
    return pipe.tokenizer.encode_batch([text], add_special_tokens=not chat)[0].ids


def _prompt_images(pipe, req: openai.ApiRequest, ids: list[int], media: MediaLimits):
    """The chat's images read from their URLs and made the vision tower's input, and ``ids`` with
    each image's placeholder run grown to its tokens. ApiError naming the part at fault."""
    from stagewise.frontend.image_processing import ImageError, expand_prompts

    files = []
    for where, url in req.images:
        try:
            files.append(read_image_url(url, media))
        except ValueError as err:
            raise openai.ApiError(f"{where}: {err}", param=where) from None
    try:
        inputs = pipe.image_processor(files)
    except ImageError as err:
        where = req.images[err.index][0]
        raise openai.ApiError(f"{where}: {str(err).partition(': ')[2]}", param=where) from None
    expanded = [ids]
    problems = expand_prompts(expanded, [inputs], pipe.config.vision_config, {})
    if problems:
        raise openai.ApiError(f"the rendered chat does not match its images: {problems[0].partition(': ')[2]}",
                              param="messages")
    _check_prompt(pipe, expanded[0], req)
    return inputs, expanded[0]


def _check_prompt(pipe, ids: list[int], req: openai.ApiRequest) -> None:
    problem = prompt_problem(ids, pipe.config.vocab_size)
    if problem:
        raise openai.ApiError(problem, param="messages" if req.chat and not ids else "prompt")
    if (why := request_problem(req.params, pipe.checkpoint, pipe.tokenizer)) is not None:
        raise openai.ApiError(why, param="stop" if req.params.stop and pipe.tokenizer is None else None)
    try:
        pipe.check_lengths([ids], [req.params])
    except ValueError as err:
        raise openai.ApiError(str(err).replace("Pipeline.generate: ", "").replace("prompt 0", "the prompt")
                              .replace("max_new_tokens", req.max_tokens_param),
                              param=("messages" if req.chat else "prompt") if len(ids) >= pipe.max_model_len
                              else req.max_tokens_param,
                              code="context_length_exceeded") from None


def _choice(req: openai.ApiRequest, text: str, lps, piece, finish: str | None, offset: int = 0,
            first: bool = False, reasoning: str = "", calls: list | None = None) -> dict:
    if req.chat:
        delta = {"role": "assistant"} if first else {}
        if reasoning:
            delta["reasoning_content"] = reasoning
        if text or not (reasoning or calls):
            delta["content"] = text
        if calls:
            delta["tool_calls"] = calls
        choice = {"index": 0, "delta": delta}
        if req.logprobs is not None:
            choice["logprobs"] = openai.chat_logprobs(lps, piece)
    else:
        choice = {"index": 0, "text": text}
        choice["logprobs"] = openai.completion_logprobs(lps, piece, offset) if req.logprobs is not None else None
    choice["finish_reason"] = finish
    return choice


def _sse(obj) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


async def _events(loop: ServeLoop, rid: int, stream: _Stream, req, name: str, model: str, piece, prompt_len: int):
    done = False
    offset, first = 0, True
    calls = ToolStream(req.tools) if req.tools is not None else None
    think = ReasoningStream(req.reasoning) if req.reasoning is not None else None
    try:
        while True:
            kind, a, b = await stream.queue.get()
            if kind == "text":
                r, a = think.feed(a) if think is not None else ("", a)
                a, found = (a, []) if calls is None else calls.feed(a)
                if not a and not r and not b and not found:
                    continue
                yield _sse(openai.body(req, name, model, _choice(req, a, b, piece, None, offset, first, r, found),
                                       None, True))
                offset, first = offset + len(a), False
                continue
            done = True
            result: Completion = a
            if result.finish_reason == "error":
                yield _sse({"error": {"message": result.error, "type": "server_error", "param": None, "code": None}})
            finish = openai.FINISH[result.finish_reason]
            r, tail = think.finish() if think is not None else ("", "")
            found = []
            if calls is not None and result.finish_reason != "error":
                tail, found = calls.end(tail)
                finish = "tool_calls" if (calls.called or found) and finish == "stop" else finish
            if tail or found or r:
                yield _sse(openai.body(req, name, model, _choice(req, tail, [], piece, None, offset, first, r, found),
                                       None, True))
                first = False
            yield _sse(openai.body(req, name, model, _choice(req, "", [], piece, finish, offset, first), None, True))
            if req.include_usage:
                yield _sse(openai.body(req, name, model, {}, openai.usage(prompt_len, len(result.token_ids),
                                                                           result.cached_tokens), True))
            yield b"data: [DONE]\n\n"
            return
    finally:
        if not done:  # the client went away: its request ends and its KV is freed
            loop.cancel(rid)


async def _whole(request: Request, loop: ServeLoop, rid: int, stream: _Stream, req, name: str, model: str,
                 piece) -> Response:
    lps: list = []
    while True:
        try:
            kind, a, b = await asyncio.wait_for(stream.queue.get(), timeout=0.5)
        except asyncio.TimeoutError:
            if await request.is_disconnected():
                loop.cancel(rid)
                return Response(status_code=499)
            continue
        if kind == "text":
            lps += b
            continue
        result: Completion = a
        break
    if result.finish_reason == "error":
        return _error(openai.ApiError(f"the request failed: {result.error}", status=500, type="server_error"))
    finish = openai.FINISH[result.finish_reason]
    if req.chat:
        thinking, text = (None, result.text) if req.reasoning is None else split(req.reasoning, result.text)
        content, calls = (text, []) if req.tools is None else req.tools.parse(text)
        message = {"role": "assistant", "content": content, **({"tool_calls": calls} if calls else {}),
                   **({"reasoning_content": thinking} if req.reasoning is not None else {})}
        choice = {"index": 0, "message": message,
                  "logprobs": openai.chat_logprobs(lps, piece) if req.logprobs is not None else None,
                  "finish_reason": "tool_calls" if calls and finish == "stop" else finish}
    else:
        choice = {"index": 0, "text": result.text, "finish_reason": finish,
                  "logprobs": openai.completion_logprobs(lps, piece) if req.logprobs is not None else None}
    use = openai.usage(len(result.prompt_token_ids), len(result.token_ids), result.cached_tokens)
    return JSONResponse(openai.body(req, name, model, choice, use))
