"""OpenAI-compatible routes: /v1/chat/completions, /v1/completions, /v1/models."""

from __future__ import annotations

from aiohttp import web

from radixserve.server import protocol as P
from radixserve.server.body import expect_continue, read_json
from radixserve.server.errors import ApiError
from radixserve.server.openapi import RouteDoc, documented
from radixserve.server.openai_serving import (ChatRenderer, CompletionRenderer, Renderer,
                                              run_on_engine, run_to_response)
from radixserve.server.prompts import ModelInfo, prepare_chat, prepare_completion
from radixserve.server.sse import stream_events
from radixserve.server.state import STATE, ServerState, caller, json_response


@documented(RouteDoc("Chat completion (OpenAI); server-sent events with stream=true",
                     body=P.ChatCompletionRequest, response=P.ChatCompletionResponse,
                     stream=P.ChatCompletionChunk, errors=(404,)))   # 404: another model
async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await serve(request, ChatRenderer, P.ChatCompletionRequest, prepare_chat)


@documented(RouteDoc("Text completion (OpenAI); server-sent events with stream=true",
                     body=P.CompletionRequest, response=P.CompletionResponse,
                     stream=P.CompletionChunk, errors=(404,)))       # 404: another model
async def completions(request: web.Request) -> web.StreamResponse:
    return await serve(request, CompletionRenderer, P.CompletionRequest, prepare_completion)


async def serve(request: web.Request, renderer_type: type[Renderer], request_type: type,
                prepare) -> web.StreamResponse:
    """Decode, prepare (tokenize off the loop) and run one chat or completions request."""
    state = request.app[STATE]
    req = await read_json(request, request_type)
    prepared = await prepare(req, state.prompts, caller(request).key_namespace)
    renderer = renderer_type(state.info.name, prepared, state.engine.tokenizer,
                             req.include_usage)
    return await respond(request, state, renderer, req.stream)


async def respond(request: web.Request, state: ServerState, renderer: Renderer,
                  stream: bool) -> web.StreamResponse:
    observer = state.metrics.observer(renderer.prepared.params.n)
    with state.track() as request_id:
        if not stream:
            return json_response(await run_to_response(state.engine, renderer, observer,
                                                       request_id))
        async with run_on_engine(state.engine, renderer.prepared, observer,
                                 request_id) as outputs:
            return await stream_events(request, outputs, renderer, state.config.sse_keepalive_s,
                                       state.stop_event(request_id))


@documented(RouteDoc("The served model (OpenAI)", response=P.ModelList))
async def list_models(request: web.Request) -> web.Response:
    info = request.app[STATE].info
    return json_response(P.ModelList("list", [_card(info)]))


@documented(RouteDoc("One model by name (OpenAI)", response=P.ModelCard, errors=(404,)))
async def get_model(request: web.Request) -> web.Response:
    info = request.app[STATE].info
    if request.match_info["model"] != info.name:
        raise ApiError(404, f"the model {request.match_info['model'][:200]!r} does not exist",
                       type="not_found_error", param="model", code="model_not_found")
    return json_response(_card(info))


def _card(info: ModelInfo) -> P.ModelCard:
    return P.ModelCard(id=info.name, object="model", created=info.created, owned_by="radixserve",
                       max_model_len=info.max_model_len)


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/chat/completions", chat_completions,
                        expect_handler=expect_continue)
    app.router.add_post("/v1/completions", completions, expect_handler=expect_continue)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/v1/models/{model:.+}", get_model)
