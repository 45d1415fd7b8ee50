"""The OpenAI Responses API: POST /v1/responses, GET and DELETE /v1/responses/{id}.

A turn runs as a chat request (same pipeline and checks as /v1/chat/completions); a stored
response keeps the conversation and its exact token ids (conversations.py), so a follow-up
with `previous_response_id` hits its whole history. Ids are scoped to the key that made
them: another key's id is a 404, exactly like an unknown one.
"""

from __future__ import annotations

from typing import AsyncIterator

from aiohttp import web

from radixserve.engine.outputs import RequestOutput
from radixserve.server.body import expect_continue, read_json
from radixserve.server.conversations import Conversations, TurnPrompt, new_response_id
from radixserve.server.openai_serving import run_on_engine
from radixserve.server.openapi import RouteDoc, documented
from radixserve.server.pin_sweeper import PinSweeper, background
from radixserve.server.responses_protocol import (DeletedResponse, ResponseObject,
                                                  ResponsesRequest)
from radixserve.server.responses_serving import ResponseBuilder
from radixserve.server.sse import stream_events
from radixserve.server.state import STATE, ServerState, caller, json_response


def _conversations(state: ServerState) -> Conversations:
    assert state.conversations is not None
    return state.conversations


@documented(RouteDoc("Create a response (OpenAI Responses API); server-sent events (typed "
                     "events) with stream=true", body=ResponsesRequest, response=ResponseObject,
                     stream=dict, errors=(404,)))
async def create_response(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    conv = _conversations(state)
    req = await read_json(request, ResponsesRequest)
    who = caller(request)
    turn = await conv.prompt(req, state.prompts, who.owner, who.key_namespace)
    builder = ResponseBuilder(new_response_id(), state.info.name, req, turn,
                              state.engine.tokenizer)
    observer = state.metrics.observer(1)
    with state.track() as request_id:
        async with run_on_engine(state.engine, turn.prepared, observer, request_id) as outputs:
            finished = _stored(outputs, builder, conv, who.owner)
            if req.stream:
                return await stream_events(request, finished, builder,
                                           state.config.sse_keepalive_s,
                                           state.stop_event(request_id))
            async for _ in finished:
                pass
    if (err := builder.failure()) is not None:
        raise err
    return json_response(builder.response())


async def _stored(outputs: AsyncIterator[RequestOutput], builder: ResponseBuilder,
                  conv: Conversations, owner: str | None) -> AsyncIterator[RequestOutput]:
    """The outputs, each added to `builder`; a finished response is stored (with `store`)
    before its last output is passed on, so its id is usable once the client sees it."""
    turn: TurnPrompt = builder.turn
    async for out in outputs:
        builder.add(out)
        if out.finished and builder.req.store and builder.failure() is None:
            await conv.remember(turn, owner, builder.id, builder.reply, builder.token_ids,
                                builder.body(), builder.created_at)
        yield out


@documented(RouteDoc("A stored response, by id (the caller's own only)",
                     response=ResponseObject, errors=(404,)))
async def get_response(request: web.Request) -> web.Response:
    state = request.app[STATE]
    item = _conversations(state).store.get(request.match_info["response_id"],
                                           caller(request).owner)
    return json_response(item.body)


@documented(RouteDoc("Delete a stored response (the caller's own only)",
                     response=DeletedResponse, errors=(404,)))
async def delete_response(request: web.Request) -> web.Response:
    state = request.app[STATE]
    response_id = request.match_info["response_id"]
    item = await _conversations(state).delete(response_id, caller(request).owner)
    return json_response(DeletedResponse(item.id, "response", True))


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/responses", create_response, expect_handler=expect_continue)
    app.router.add_get("/v1/responses/{response_id}", get_response)
    app.router.add_delete("/v1/responses/{response_id}", delete_response)
    conv = app[STATE].conversations
    if conv is not None:        # lapsed response and cache_control pins go without traffic
        app.cleanup_ctx.append(background(PinSweeper([conv.pins, conv.breakpoints])))

