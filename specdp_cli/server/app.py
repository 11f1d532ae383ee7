"""The OpenAI-compatible HTTP API: /v1/models, /v1/completions, /v1/chat/completions, /health,
/metrics, and the OpenAPI schema at /openapi.json. Responses and streams follow the OpenAI schema;
every client mistake is a 4xx with an OpenAI-style error body, and so is every other failure of
the HTTP layer: a bug is a 500 with that body (logged with its traceback) and the server goes on.

The two generation endpoints are served straight from ASGI (`GenerationPaths`, in front of FastAPI):
FastAPI's middleware, routing and Starlette's streaming response cost the one event loop about a
millisecond a request and more per chunk, which at hundreds of requests a second sets the time to
first token. FastAPI keeps the other routes and the schema (whose generation routes are declared
there for /openapi.json only)."""
from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from .frontend import Event, Frontend, IncrementalText, Inflight, text_decoder
from .logprobs import chat_logprobs, completion_logprobs
from .metrics import CONTENT_TYPE
from .protocol import APIError, GenRequest, parse_json, parse_request
from .schema import request_body

log = logging.getLogger("specdp.server")


def build_app(frontend: Frontend, encoder, tokenizer, model_name: str, max_model_len: int, defaults,
              api_key: str | None) -> FastAPI:
    app = FastAPI(title="specdp", docs_url=None, redoc_url=None, openapi_url="/openapi.json")
    api_key = api_key or os.environ.get("SPECDP_API_KEY") or None

    @app.exception_handler(APIError)
    async def _api_error(_request: Request, e: APIError):
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(404)
    async def _not_found(_request: Request, _e):
        return JSONResponse(APIError(404, "no such route").body(), status_code=404)

    @app.exception_handler(405)
    async def _bad_method(_request: Request, _e):
        return JSONResponse(APIError(405, "method not allowed").body(), status_code=405)

    @app.exception_handler(Exception)
    async def _bug(request: Request, e: Exception):
        log.error("internal error on %s %s", request.method, request.url.path, exc_info=e)
        return JSONResponse(APIError(500, f"internal server error ({type(e).__name__}); the server goes on "
                                          f"serving").body(), status_code=500)

    def check_auth(request: Request) -> None:
        if api_key and request.headers.get("authorization") != f"Bearer {api_key}":
            raise APIError(401, "missing or wrong API key (send Authorization: Bearer <key>)", code="invalid_api_key")

    @app.get("/health")
    async def health():
        if frontend.healthy and not frontend.draining:
            return Response(status_code=200)
        return JSONResponse({"status": frontend.failed or ("draining" if frontend.draining else "starting")},
                            status_code=503)

    @app.get("/metrics")
    async def metrics():
        up = len(frontend.link.up) if frontend.link else 0
        return Response(frontend.metrics.render(up), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models(request: Request):
        check_auth(request)
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": int(time.time()),
                                            "owned_by": "specdp", "max_model_len": max_model_len}]}

    @app.post("/v1/completions", openapi_extra=request_body("completion"))
    async def completions():
        raise RuntimeError("unreachable: GenerationPaths serves this path before FastAPI")

    @app.post("/v1/chat/completions", openapi_extra=request_body("chat"))
    async def chat_completions():
        raise RuntimeError("unreachable: GenerationPaths serves this path before FastAPI")

    return GenerationPaths(app, frontend, encoder, tokenizer, model_name, max_model_len, defaults, api_key)


GENERATION_PATHS = {"/v1/completions": False, "/v1/chat/completions": True}      # path -> chat
MAX_BODY = 64 << 20
# A request body from this size on is turned into a request (its prompt tokenized, its chat template applied) on a
# thread of its own, not on the event loop: the tokenizer (Rust) releases the GIL, so the loop goes on streaming
# every other request's tokens. A 17k-token prompt took 23 ms to tokenize, a 67k-token one 93 ms, and every stream
# stood still that long. Smaller bodies stay on the loop, where the hop to a thread would cost more than it saves.
ENCODE_OFF_LOOP_BYTES = 16 << 10
DISCONNECTED = Event([], "disconnect")       # put in a request's queue when its client goes away
DONE = "data: [DONE]\n\n"                    # a stream's last event (what the generation's last piece ends with)


class GenerationPaths:
    """ASGI: POST /v1/completions and /v1/chat/completions answered here, everything else by FastAPI."""

    def __init__(self, app, frontend: Frontend, encoder, tokenizer, model_name: str, max_model_len: int, defaults,
                 api_key: str | None):
        self.app, self.frontend, self.encoder, self.tokenizer = app, frontend, encoder, tokenizer
        self.model_name, self.max_model_len, self.defaults, self.api_key = model_name, max_model_len, defaults, api_key
        self.encode_pool: ThreadPoolExecutor | None = None     # long prompts' tokenization (ENCODE_OFF_LOOP_BYTES)

    async def __call__(self, scope, receive, send) -> None:
        chat = GENERATION_PATHS.get(scope.get("path")) if scope["type"] == "http" else None
        if chat is None or scope["method"] != "POST":
            return await self.app(scope, receive, send)
        started = []                                   # the response's start has been sent
        try:
            await self._generate(scope, receive, send, chat, started)
        except APIError as e:
            if not started:
                await _respond(send, e.status, json.dumps(e.body()).encode(), e.headers)
        except Exception as e:  # noqa: BLE001 - a bug: an OpenAI-shaped 500, the server goes on
            log.error("internal error on POST %s", scope["path"], exc_info=e)
            if not started:
                body = APIError(500, f"internal server error ({type(e).__name__}); the server goes on serving").body()
                await _respond(send, 500, json.dumps(body).encode())
            else:
                await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _generate(self, scope, receive, send, chat: bool, started: list) -> None:
        frontend = self.frontend
        if self.api_key:
            auth = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
            if auth != f"Bearer {self.api_key}":
                raise APIError(401, "missing or wrong API key (send Authorization: Bearer <key>)",
                               code="invalid_api_key")
        raw = await _read_body(receive)
        if raw is None:
            return                                     # the client left before its request arrived
        args = (parse_json(raw), chat, self.encoder, self.model_name, self.max_model_len, self.defaults)
        if len(raw) >= ENCODE_OFF_LOOP_BYTES:
            if self.encode_pool is None:         # one thread: long prompts are tokenized one at a time
                self.encode_pool = ThreadPoolExecutor(1, thread_name_prefix="specdp-encode")
            req = await asyncio.get_running_loop().run_in_executor(self.encode_pool, parse_request, *args)
        else:
            req = parse_request(*args)
        infs: list[Inflight] = []
        try:
            for i in range(1 if req.stream else req.n):    # n choices: n requests, spread over the ranks as any are
                infs.append(frontend.submit(req.choice(i)))
        except APIError:
            for inf in infs:
                frontend.abort(inf)
            raise
        # the client going away (the ASGI server's http.disconnect) reaches each request's mailbox
        gone = asyncio.ensure_future(receive())
        gone.add_done_callback(lambda _: [inf.mailbox.put(DISCONNECTED) for inf in infs if not inf.done])
        try:
            if req.stream:
                await send({"type": "http.response.start", "status": 200,
                            "headers": [(b"content-type", b"text/event-stream; charset=utf-8"),
                                        (b"cache-control", b"no-cache")]})
                started.append(True)
                # the stream's last piece (its end and [DONE]) goes with the end of the response: the ASGI server
                # writes both at once, a request's end one write to its client
                ended = False
                async for chunk in _stream(frontend, self.tokenizer, infs[0], req):
                    ended = chunk.endswith(DONE)
                    await send({"type": "http.response.body", "body": chunk.encode(), "more_body": not ended})
                if not ended:
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
            else:
                result = await _collect(frontend, infs, req, self.tokenizer)
                if result is not None:
                    await _respond(send, 200, json.dumps(result).encode())
        finally:
            gone.cancel()


async def _read_body(receive) -> bytes | None:
    parts, size = [], 0
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            return None
        parts.append(msg.get("body", b""))
        size += len(parts[-1])
        if size > MAX_BODY:
            raise APIError(413, f"the request body is over {MAX_BODY >> 20} MiB")
        if not msg.get("more_body"):
            return b"".join(parts)


async def _respond(send, status: int, body: bytes, headers: dict | None = None) -> None:
    hs = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    hs += [(k.lower().encode("latin-1"), str(v).encode("latin-1")) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": hs})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def _usage(stats: dict | None, inf: Inflight) -> dict:
    p = len(inf.req.prompt_ids)
    c = stats["completion_tokens"] if stats else inf.n_tokens
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


async def _collect(frontend: Frontend, infs: list[Inflight], req: GenRequest, tokenizer) -> dict | None:
    """A non-streamed answer with one choice per request in `infs`; None when the client went away meanwhile
    (then every choice is aborted)."""
    tokens: dict[str, list[int]] = {inf.id: [] for inf in infs}      # each choice's tokens and log-probabilities
    logprobs: dict[str, list] = {inf.id: [] for inf in infs}

    async def finished(inf: Inflight) -> Event | None:
        while True:
            for ev in await inf.mailbox.take():
                if ev.finish_reason == "disconnect":
                    return None
                frontend.note_tokens(inf, len(ev.new_tokens))
                tokens[inf.id] += ev.new_tokens
                logprobs[inf.id] += ev.logprobs or []
                if ev.finish_reason is not None:
                    return ev

    try:
        events = await asyncio.gather(*(finished(inf) for inf in infs))
    except asyncio.CancelledError:
        for inf in infs:
            frontend.abort(inf)
        raise
    if any(ev is None for ev in events):
        for inf in infs:
            frontend.abort(inf)
        return None
    failed = next((ev for ev in events if ev.finish_reason in ("error", "abort")), None)
    for inf, ev in zip(infs, events):
        bad = ev.finish_reason in ("error", "abort")
        frontend.release(inf, "error" if bad else ev.finish_reason, None if bad else ev.stats)
    if failed is not None:
        raise APIError(failed.status, failed.error or "the request was aborted")
    choices = []
    asked = req.params.get("logprobs") is not None
    for i, (inf, ev) in enumerate(zip(infs, events)):
        text = text_decoder(tokenizer)(tokens[inf.id])
        text = text[:ev.stop_text_end] if ev.stop_text_end is not None else text
        if req.chat:
            lp = chat_logprobs(tokenizer, tokens[inf.id], logprobs[inf.id]) if asked else None
            choices.append({"index": i, "message": {"role": "assistant", "content": text}, "logprobs": lp,
                            "finish_reason": ev.finish_reason})
        else:
            lp = completion_logprobs(tokenizer, tokens[inf.id], logprobs[inf.id], len(req.echo)) if asked else None
            choices.append({"index": i, "text": req.echo + text, "logprobs": lp, "finish_reason": ev.finish_reason})
    usages = [_usage(ev.stats, inf) for inf, ev in zip(infs, events)]
    completion = sum(u["completion_tokens"] for u in usages)
    usage = {"prompt_tokens": usages[0]["prompt_tokens"], "completion_tokens": completion,
             "total_tokens": usages[0]["prompt_tokens"] + completion}
    return {"id": infs[0].id, "object": "chat.completion" if req.chat else "text_completion",
            "created": int(time.time()), "model": req.echo_model, "choices": choices, "usage": usage}


def _sse(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def _merge(events: list[Event]) -> Event:
    """Events of a stream as one (the last one's end, all their tokens)."""
    last = events[-1]
    tokens = [t for ev in events for t in ev.new_tokens]
    lp = None if all(ev.logprobs is None for ev in events) else [x for ev in events for x in ev.logprobs or []]
    return Event(tokens, last.finish_reason, last.stop_text_end, last.stats, last.error, last.status, lp)


async def _next_event(inf: Inflight) -> Event:
    """The stream's next event, merged with every one that arrived behind it, up to the first that ends it: when
    the frontend falls behind the ranks, a chunk carries several steps' tokens instead of the chunks piling up
    (vLLM merges alike), so a busy frontend costs inter-token latency, not throughput."""
    events = await inf.mailbox.take()
    end = next((i for i, ev in enumerate(events) if ev.finish_reason is not None), len(events) - 1) + 1
    if end < len(events):
        inf.mailbox.put_back(events[end:])
    return events[0] if end == 1 else _merge(events[:end])


async def _stream(frontend: Frontend, tokenizer, inf: Inflight, req: GenRequest):
    created = int(time.time())
    text = IncrementalText(tokenizer, req.stop)
    base = {"id": inf.id, "object": "chat.completion.chunk" if req.chat else "text_completion",
            "created": created, "model": req.echo_model}

    asked = req.params.get("logprobs") is not None
    offset = len(req.echo)                   # completions: where the next token's text starts

    def chunk(delta: str | None, finish: str | None, role: bool = False, ev: Event | None = None) -> dict:
        """A chunk of text; with log-probabilities asked, those of the event's tokens (`ev`), which may come
        with less text or none (text held back for a stop string) — every token's entry arrives once."""
        nonlocal offset
        lp = None
        if asked and ev is not None:
            lp = (chat_logprobs(tokenizer, ev.new_tokens, ev.logprobs or []) if req.chat else
                  completion_logprobs(tokenizer, ev.new_tokens, ev.logprobs or [], offset))
            offset += sum(len(t) for t in lp.get("tokens", ()))
        if req.chat:
            d = {"role": "assistant", "content": ""} if role else ({"content": delta} if delta else {})
            c = {"index": 0, "delta": d, "logprobs": lp, "finish_reason": finish}
        else:
            c = {"index": 0, "text": delta or "", "logprobs": lp, "finish_reason": finish}
        return {**base, "choices": [c]}

    # the chunk of most events (text, no log-probabilities) as a template: only the text is encoded per chunk
    head, tail = json.dumps(chunk("\0", None)).split(json.dumps("\0"))
    head, tail = "data: " + head, tail + "\n\n"

    finished = False
    try:
        if req.chat:
            yield _sse(chunk(None, None, role=True))
        elif req.echo:                   # completions' echo: the prompt's text first
            yield _sse(chunk(req.echo, None))
        while True:
            ev: Event = await _next_event(inf)
            if ev.finish_reason == "disconnect":
                return                       # the client went away: `finally` aborts the request
            frontend.note_tokens(inf, len(ev.new_tokens))
            if ev.finish_reason in ("error", "abort"):
                finished = True
                frontend.release(inf, "error")
                yield _sse({"error": {"message": ev.error or "the request was aborted", "type": "server_error",
                                      "param": None, "code": None}})
                break
            if ev.finish_reason is None:
                delta = text.add(ev.new_tokens)
                if asked and ev.new_tokens:
                    yield _sse(chunk(delta, None, ev=ev))
                elif delta:
                    yield head + json.dumps(delta) + tail
                continue
            finished = True
            delta = text.finish(ev.new_tokens, ev.stop_text_end)     # everything not sent yet, stop string cut
            frontend.release(inf, ev.finish_reason, ev.stats)
            end = [_sse(chunk(delta, None, ev=ev))] if delta or (asked and ev.new_tokens) else []
            end.append(_sse(chunk(None, ev.finish_reason)))
            if req.include_usage:
                end.append(_sse({**base, "choices": [], "usage": _usage(ev.stats, inf)}))
            yield "".join(end) + DONE       # the stream's end in one piece
            return
        yield DONE
    finally:
        if not finished:                 # the client went away mid-stream: free its slot
            frontend.abort(inf)
