"""OpenAI-compatible routes: /v1/chat/completions, /v1/completions, /v1/models.

Streaming is server-sent events. The response headers go out only after the engine's first
output, so a request the engine refuses (bad parameters, full queue) still gets a proper
status code instead of an error inside a 200 stream.
"""

from __future__ import annotations

from contextlib import aclosing
from typing import AsyncIterator

from aiohttp import web

from radixserve.engine.outputs import RequestOutput
from radixserve.server import protocol as P
from radixserve.server import sse
from radixserve.server.app import KEY_NAMESPACE, STATE, ServerState, json_response, read_body
from radixserve.server.errors import ApiError
from radixserve.server.openai_serving import (Renderer, engine_outputs, prepare_chat,
                                              prepare_completion, run_to_response)

async def chat_completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    req = P.decode(await read_body(request), P.ChatCompletionRequest)
    prepared = prepare_chat(req, state.engine.tokenizer, state.info, request.get(KEY_NAMESPACE))
    renderer = Renderer("chat", state.info.name, prepared, state.engine.tokenizer)
    return await respond(request, state, renderer, req.stream, req.include_usage)


async def completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    req = P.decode(await read_body(request), P.CompletionRequest)
    prepared = prepare_completion(req, state.engine.tokenizer, state.info,
                                  request.get(KEY_NAMESPACE))
    renderer = Renderer("completion", state.info.name, prepared, state.engine.tokenizer)
    return await respond(request, state, renderer, req.stream, req.include_usage)


async def respond(request: web.Request, state: ServerState, renderer: Renderer, stream: bool,
                  include_usage: bool) -> web.StreamResponse:
    observer = state.metrics.observer(renderer.prepared.params.n)
    with state.track() as request_id:
        if not stream:
            body = await run_to_response(state.engine, renderer, observer, request_id)
            return json_response(body)
        outputs = engine_outputs(state.engine, renderer.prepared, observer, request_id)
        async with aclosing(outputs):
            return await stream_sse(request, renderer, outputs, include_usage)


async def stream_sse(request: web.Request, renderer: Renderer,
                     outputs: AsyncIterator[RequestOutput], include_usage: bool) -> web.StreamResponse:
    """Write the outputs as SSE chunks. A client that goes away raises out of `write`
    (or cancels this task); the caller's `aclosing` then aborts the engine request."""
    out = await anext(outputs, None)            # engine refusals raise here, before headers
    response = await sse.open_stream(request)
    try:
        while out is not None:
            renderer.add(out)
            chunk = renderer.chunk(out)
            if chunk is not None:
                await response.write(sse.event(chunk))
            if out.finished and (err := Renderer.failure(out)) is not None:
                await response.write(sse.event(err.body()))
                break
            out = await anext(outputs, None)
        else:
            if include_usage:
                await response.write(sse.event(renderer.usage_chunk()))
        await response.write(sse.DONE)
    except ConnectionResetError:
        pass                                     # client gone; aclosing aborts the request
    return response


async def list_models(request: web.Request) -> web.Response:
    info = request.app[STATE].info
    return json_response(P.ModelList("list", [_card(info)]))


async def get_model(request: web.Request) -> web.Response:
    info = request.app[STATE].info
    if request.match_info["model"] != info.name:
        raise ApiError(404, f"the model {request.match_info['model']!r} does not exist",
                       type="not_found_error", param="model", code="model_not_found")
    return json_response(_card(info))


def _card(info) -> P.ModelCard:
    return P.ModelCard(id=info.name, object="model", created=info.created, owned_by="radixserve",
                       max_model_len=info.max_model_len)


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/v1/models/{model:.+}", get_model)
