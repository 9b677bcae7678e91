"""The FastAPI app: routes, bearer-key auth, OpenAI error shapes, and the bridge to the Router (the same
admission control, validation, metrics and speculative loop as gRPC). Each of a request's n choices is one
router request; a client that goes away cancels them, which frees the workers' caches as a gRPC cancel does.
"""
from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import re
import types
import uuid
from pathlib import Path
from typing import Annotated, AsyncIterator, Callable, Literal

import grpc
from fastapi import Depends, FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from openai_api import beam_search
from openai_api.chat import ChatTemplate, find_chat_template, no_template_error
from openai_api.functions import as_tools, deprecated_plan
from openai_api.protocol import (DEFAULT_CHAT_MAX_TOKENS, ApiError, ChatRequest, CompletionRequest,
                                 DetokenizeRequest, SamplingBody, TokenizeRequest, completion_prompts,
                                 generate_request, http_error, with_seed)
from openai_api.background import BackgroundRun
from openai_api.reasoning import for_request as reasoning_for
from openai_api.response_store import Stored, open_store
from openai_api.responses_api import (Includable, ResponseObjects, ResponsesRequest, as_input, chat_request,
                                      continued, input_items, listed, page, responses_error, text_size, with_ids)
from openai_api.tools import PARSERS
from openai_api.choices import FINISH, ChatCompletions, Completions
from router.bearer import allowed
from router.failures import worker_failure
from router.request_log import ClientRequest
from router.server import Overloaded, Router
from router.stopping import output_chunks
from router.text import encode
from router.validation import MAX_REQUEST_ID_CHARS, RequestError, check_token_ids
from settings.schema import HttpConfig

GRPC_CODES = {400: "INVALID_ARGUMENT", 401: "UNAUTHENTICATED", 404: "NOT_FOUND", 429: "RESOURCE_EXHAUSTED",
              503: "UNAVAILABLE"}      # an API error's code in specpool_requests_total (ApiError.grpc_code: its own)
# the requests specpool_requests_total counts
GENERATION_ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/responses")
BODY_ERRORS = {"json_invalid": "invalid JSON ({error} at character {at})", "missing": "empty: send a JSON object"}
FIELD_ERRORS = {"extra_forbidden": "unknown key"}       # pydantic's messages that would not say what is wrong


class ClientDisconnected(Exception):
    """The client went away before its (whole) answer: its request was cancelled, and nobody reads a reply."""


LOADING = "specpool is still loading its worker pools"    # before the pools have loaded, unless told for how long


class Api:
    """The routes' shared state: the config, the Router once the pools are ready, the chat template."""

    def __init__(self, http: HttpConfig, get_router: Callable[[], Router | None],
                 loading: Callable[[], str] = lambda: LOADING):
        self.http, self._get_router, self._loading = http, get_router, loading
        self._templates: dict = {}
        self.stored = open_store(http)          # the Responses API's stored responses

    def router(self) -> Router:
        current = self._get_router()
        if current is None:
            raise ApiError(503, self._loading(), kind="service_unavailable")
        if current.draining:
            raise ApiError(503, "specpool is shutting down", kind="service_unavailable")
        return current

    def model_name(self, router: Router) -> str:
        return self.http.model_name or Path(router.model_info["model_path"]).name

    def authorize(self, request: Request) -> None:
        if not allowed(self.http.api_keys, request.headers.get("authorization")):
            raise ApiError(401, "missing or wrong API key (Authorization: Bearer <key>)", kind="authentication_error",
                           code="invalid_api_key")

    def chat_template(self, router: Router) -> ChatTemplate:
        if "template" not in self._templates:
            source = find_chat_template(self.http.chat_template, router.model_info["model_path"])
            eos = router.tokenizer.id_to_token(min(router.eos_ids)) if router.eos_ids else ""
            self._templates["template"] = source and ChatTemplate(source, eos)
        if self._templates["template"] is None:
            raise no_template_error(self.model_name(router))
        return self._templates["template"]

    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        router = self.router()
        model = check_model(body, self.model_name(router))
        if body.use_beam_search:
            beam_search.check(body)
        prompts = completion_prompts(body)
        generates = [generate_request(body, prompt, body.max_tokens, body.logprobs) for prompt in prompts]
        echo = [prompt if isinstance(prompt, str) else True for prompt in prompts for _ in range(body.n)]
        kind = Completions(_decoder(router), _text_of(router, body.skip_special_tokens), echo if body.echo else False,
                           body.logprobs)
        if body.use_beam_search:
            return await beam_answer(request, router, body, generates, kind, model)
        return await answer(request, router, body, generates, kind, model)

    async def chat(self, body: ChatRequest, request: Request) -> Response:
        router = self.router()
        model = check_model(body, self.model_name(router))
        if body.use_beam_search:
            beam_search.check(body)
        body, deprecated = as_tools(body, PARSERS.get(self.http.tool_call_parser))
        generate, plan, reasoning = self.chat_generate(router, body, deprecated)
        kind = ChatCompletions(_decoder(router), plan, deprecated, reasoning)
        if body.use_beam_search:
            return await beam_answer(request, router, body, [generate], kind, model)
        return await answer(request, router, body, [generate], kind, model)

    async def responses(self, body: ResponsesRequest, request: Request) -> Response:
        """OpenAI's Responses API, as the chat completion it stands for (openai_api/responses_api.py); errors
        name the parameters the request sent."""
        try:
            router = self.router()
            model = check_model(body, self.model_name(router))
            owner = self.owner(request)
            items = self.conversation(body, owner)
            chat = chat_request(body, items)
            generate, plan, reasoning = self.chat_generate(router, chat)
            run = self.background(body)
            kind = ResponseObjects(_decoder(router), plan, body, self.storing(body, items, owner, run), reasoning)
            if run is not None:
                held = Stored({}, items, 0, owner, len(items), run)        # found while it runs (its input listed)
                return await self.in_background(request, router, chat, [generate], kind, model, held)
            return await answer(request, router, chat, [generate], kind, model)
        except ApiError as error:
            raise responses_error(error) from None

    def background(self, body: ResponsesRequest) -> BackgroundRun | None:
        """A background response's run (None for another); a 400 if it could not be stored, so never polled."""
        if not body.background:
            return None
        if not body.store:
            raise ApiError(400, "background: a background response is stored, to be polled: send `store` true (the "
                           "default)", "background")
        if self.stored.capacity <= 0:
            raise ApiError(400, "background: this server stores no responses (http.store_responses is 0), so none "
                           "can be polled", "background")
        return BackgroundRun()

    async def in_background(self, request: Request, router: Router, body: ChatRequest, generates: list,
                            kind: ResponseObjects, model: str, held: Stored) -> Response:
        """Admit a background response (a 400 as any other; its place in admission reserved, or a 429 now), run it
        on, `held` in the store while it runs; answer it queued, or stream its events (a client that leaves that
        stream stops nothing)."""
        client, request_id, chunks = await prepared(request, router, body, generates, kind)
        reservations = reserved(router, client.states)
        events, run = kind.events(request_id, model), held.run
        run.start(events, sse(router, client, chunks, None, events), reservations)
        self.stored.hold(kind.id, held)
        headers = {"X-Request-Id": request_id}
        if body.stream:
            return StreamingResponse(run.follow(), media_type="text/event-stream", headers=headers)
        return JSONResponse(run.current(), headers=headers)

    def owner(self, request: Request) -> str:
        """Whose stored responses a request reaches: its API key's (a digest of it), or everyone's without keys."""
        if not self.http.api_keys:
            return ""
        return hashlib.sha256(request.headers.get("authorization", "").encode()).hexdigest()

    def storing(self, body: ResponsesRequest, items: list, owner: str,
                run: BackgroundRun | None = None) -> Callable[[dict], None] | None:
        """What keeps a response once answered, if it is to be stored: with its conversation's items, its output
        (a background one with its run's events, counted in its size)."""
        if not body.store or self.stored.capacity <= 0:
            return None

        def keep(response: dict) -> None:
            conversation = items + as_input(response["output"])
            size = text_size(conversation) + (run.size if run is not None else 0)
            self.stored.put(response, conversation, size, owner, len(items), run)
        return keep

    def conversation(self, body: ResponsesRequest, owner: str) -> list:
        """The input items of a response: the conversation of the stored response it continues, if any, then its
        own input (not the instructions it was given: a response's own replace them, as OpenAI has it). A 400 for
        an id not stored (OpenAI's), and for a call sent again that the stored conversation has."""
        if body.previous_response_id is None:
            return continued([], with_ids(input_items(body)))
        stored = self.stored.get(body.previous_response_id, owner)
        if stored is None:
            raise ApiError(400, f"previous_response_id: {self.not_stored(body.previous_response_id)}",
                           "previous_response_id", code="previous_response_not_found")
        status = (stored.run.current() if stored.run is not None else stored.response)["status"]
        if status not in ("completed", "incomplete"):       # a background response running, failed or cancelled
            raise ApiError(400, f"previous_response_id: {body.previous_response_id} is {status}: only a completed or "
                           "incomplete response is continued", "previous_response_id")
        return continued(stored.items, with_ids(input_items(body)))

    def not_stored(self, response_id: str) -> str:
        if self.stored.capacity <= 0:
            return "this server stores no responses (http.store_responses is 0): send the whole conversation in " \
                   "`input`"
        where = "this server's store keeps" if self.http.store_path else "a router keeps, until it restarts,"
        return f"no stored response {response_id!r} ({where} the last {self.stored.capacity} used)"

    def found(self, response_id: str, request: Request) -> Stored:
        """The stored response `response_id`, if the request's key stored it; a 404 otherwise."""
        stored = self.stored.get(response_id, self.owner(request))
        if stored is None:
            raise ApiError(404, f"response_id: {self.not_stored(response_id)}", "response_id",
                           code="response_not_found")
        return stored

    async def listed_input(self, response_id: str, request: Request, limit: Annotated[int, Query(ge=1, le=100)] = 20,
                           order: Literal["asc", "desc"] = "desc", after: str | None = None,
                           include: Annotated[list[Includable] | None, Query()] = None) -> dict:
        """GET /v1/responses/{id}/input_items: the items a stored response was given (its conversation before its
        output, the responses it continues included), paged as OpenAI pages them (newest first by default)."""
        stored = self.found(response_id, request)
        return page([listed(item) for item in stored.items[:stored.inputs]], order, after, limit)

    async def stored_response(self, response_id: str, request: Request, stream: bool = False,
                              starting_after: Annotated[int | None, Query(ge=0)] = None) -> Response:
        """GET: a stored response, as it was answered (no logprobs kept), a background one as it stands or, with
        `stream`, its events after `starting_after`; DELETE: forget it (a background one cancelled first). Only
        the key that stored it finds it."""
        stored = self.found(response_id, request)
        if request.method == "DELETE":
            if stored.run is not None:
                await stored.run.cancel()
            self.stored.delete(response_id, self.owner(request))
            return JSONResponse({"id": response_id, "object": "response", "deleted": True})
        if starting_after is not None and not stream:
            raise ApiError(400, "starting_after: only with stream=true", "starting_after")
        if not stream:
            return JSONResponse(stored.run.current() if stored.run is not None else stored.response)
        if stored.run is None:
            raise ApiError(400, "stream: only a background response's events are kept, to be streamed again (this "
                           "one was answered when it was created)", "stream")
        after = -1 if starting_after is None else starting_after
        return StreamingResponse(stored.run.follow(after), media_type="text/event-stream")

    async def cancel_background(self) -> None:
        """Cancel every background response still running (the server is stopping, their grace over)."""
        for stored in self.stored.running():
            await stored.run.cancel()

    async def cancel(self, response_id: str, request: Request) -> dict:
        """POST /v1/responses/{id}/cancel: stop a background response; the Response as it ended (cancelled, or
        its end if it was over: cancelling again changes nothing)."""
        stored = self.found(response_id, request)
        if stored.run is None:
            raise ApiError(400, "response_id: only a background response can be cancelled (this one was answered "
                           "when it was created)", "response_id")
        return await stored.run.cancel()

    def chat_generate(self, router: Router, body: ChatRequest, deprecated: bool = False) -> tuple:
        """The GenerateRequest of a chat request (its messages rendered by the chat template, its tools and
        structured output), its tool plan, and how its output splits into reasoning and content (None: it does
        not; openai_api/reasoning.py)."""
        plan = deprecated_plan(body, PARSERS.get(self.http.tool_call_parser), deprecated)
        prompt = self.chat_template(router).render(body.messages, plan.template_tools(), body)
        max_tokens = body.max_completion_tokens or body.max_tokens or DEFAULT_CHAT_MAX_TOKENS
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        generate = generate_request(body, prompt, max_tokens, logprobs)
        plan.prepare(generate)
        reasoning = reasoning_for(self.http.reasoning_parser, prompt)
        if reasoning is not None:
            reasoning.prepare(generate)
        return generate, plan, reasoning

    async def tokenize(self, body: TokenizeRequest) -> dict:
        """vLLM's /tokenize: the prompt's token IDs (a chat's: the ones its chat request is given, `usage`'s
        prompt_tokens), their count, the model's context length and, if asked, each token's string."""
        router = self.router()
        check_model(body, self.model_name(router))
        if body.messages is None:
            ids = await encode(router.tokenizer, body.prompt, body.add_special_tokens is not False)
        else:
            tools = [tool.model_dump(exclude_none=True) for tool in body.tools or []] or None
            ids = await encode(router.tokenizer, self.chat_template(router).render(body.messages, tools, body))
        strings = {"token_strs": [router.tokenizer.id_to_token(i) for i in ids]} if body.return_token_strs else {}
        return {"count": len(ids), "max_model_len": router.limits.max_context or None, "tokens": ids, **strings}

    async def detokenize(self, body: DetokenizeRequest) -> dict:
        router = self.router()
        check_model(body, self.model_name(router))
        try:
            check_token_ids("tokens", body.tokens, router.limits.vocab_size)
        except RequestError as exc:
            raise ApiError(400, str(exc), "tokens") from None
        return {"prompt": router.tokenizer.decode(body.tokens, skip_special_tokens=False)}

    async def models(self) -> dict:
        """The served model, with vLLM's `root` (the target model's folder or hub ID) and `max_model_len` (its
        context length; null where the model does not say), which clients read to size their prompts."""
        return {"object": "list", "data": [self.model_card(self.router())]}

    async def model(self, model: str) -> dict:
        """GET /v1/models/{model} (the SDK's models.retrieve): the served model's card; another name is a 404."""
        router = self.router()
        check_model(types.SimpleNamespace(model=model), self.model_name(router))
        return self.model_card(router)

    def model_card(self, router: Router) -> dict:
        return {"id": self.model_name(router), "object": "model", "created": 0, "owned_by": "specpool",
                "root": router.model_info["model_path"], "max_model_len": router.limits.max_context or None}

    async def health(self) -> dict:
        """200 while a target replica is ready; 503 while none is (a load balancer routes elsewhere; requests
        already here wait for one to come back), while loading and while shutting down."""
        if not self.router().serving:
            raise ApiError(503, "no target replica is ready (recovering)", kind="service_unavailable")
        return {"status": "ok"}

    def refused(self, request: Request, error: ApiError) -> JSONResponse:
        """The answer of an API error. A generation request it ends is counted in specpool_requests_total under
        the gRPC code it would have had, once the router is up (as gRPC counts): bad JSON, an unknown model, a
        wrong key, invalid fields, overload, a failed worker."""
        router = self._get_router()
        if router is not None and request.url.path in GENERATION_ROUTES:
            router.ended(client_request(request), error.grpc_code or GRPC_CODES.get(error.status, "UNKNOWN"),
                         str(error))
        return JSONResponse(error.body(), status_code=error.status)

    async def api_error(self, request: Request, exc: ApiError) -> JSONResponse:
        return self.refused(request, exc)

    async def invalid_body(self, request: Request, exc: RequestValidationError) -> JSONResponse:
        """A body that does not parse: 400 naming the first parameter at fault (the path to it in the message, its
        parameter, e.g. `prompt` for `prompt[3]`, in `param`), in OpenAI's shape; 401 first for a wrong key (the
        body is read before the key is checked)."""
        try:
            self.authorize(request)
        except ApiError as unauthorized:
            return self.refused(request, unauthorized)
        error = exc.errors()[0]
        path = "" if error["type"] == "json_invalid" else error_path(error["loc"][1:])
        detail = FIELD_ERRORS.get(error["type"], error["msg"])
        message = f"{path}: {detail}" if path else f"body: {body_message(request, error)}"
        return self.refused(request, ApiError(400, message, re.sub(r"(\[\d+\])+$", "", path) or None))


def error_path(loc: tuple) -> str:
    """Where in the body a validation error is (`messages[0].content`), from its location: the fields and
    list indices, without the tags of union members (which have a space, see protocol.one_of)."""
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif " " not in part:
            path += f".{part}" if path else part
    return path


def body_message(request: Request, error: dict) -> str:
    """What is wrong with a body that is not a JSON object."""
    if error["type"] in BODY_ERRORS:
        return BODY_ERRORS[error["type"]].format(at=error["loc"][-1], **error.get("ctx", {}))
    content_type = request.headers.get("content-type", "")
    if isinstance(error.get("input"), bytes) and "json" not in content_type:      # not parsed: not sent as JSON
        return f"send it with Content-Type: application/json (got {content_type or 'none'})"
    return "must be a JSON object"


async def http_exception(request: Request, exc: HTTPException) -> Response:
    """Starlette's own errors (404 no such route, 405 wrong method, with its Allow header) in OpenAI's shape."""
    where = f"{request.method} {request.url.path}"
    messages = {404: f"Invalid URL ({where})",
                405: f"Invalid method ({where}): use {(exc.headers or {}).get('Allow', 'another')}"}
    return JSONResponse(ApiError(exc.status_code, messages.get(exc.status_code, str(exc.detail))).body(),
                        status_code=exc.status_code, headers=exc.headers)


async def client_disconnected(request: Request, exc: ClientDisconnected) -> Response:
    return Response(status_code=499)        # nginx's "client closed request": nobody is there to read it


def create_app(http: HttpConfig, get_router: Callable[[], Router | None],
               loading: Callable[[], str] = lambda: LOADING) -> FastAPI:
    """The app, answering 503 (with `loading()`'s message) until `get_router()` returns the Router (the pools have
    loaded)."""
    api = Api(http, get_router, loading)
    app = FastAPI(title="specpool", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.stopping = api.cancel_background      # HttpServer.stop, before it closes the server
    app.add_exception_handler(ApiError, api.api_error)
    app.add_exception_handler(RequestValidationError, api.invalid_body)
    app.add_exception_handler(HTTPException, http_exception)
    app.add_exception_handler(ClientDisconnected, client_disconnected)
    authorized = [Depends(api.authorize)]
    app.add_api_route("/health", api.health, methods=["GET"])
    app.add_api_route("/v1/models", api.models, methods=["GET"], dependencies=authorized)
    app.add_api_route("/v1/models/{model:path}", api.model, methods=["GET"], dependencies=authorized)
    app.add_api_route("/v1/completions", api.completions, methods=["POST"], dependencies=authorized)
    app.add_api_route("/v1/chat/completions", api.chat, methods=["POST"], dependencies=authorized)
    app.add_api_route("/v1/responses", api.responses, methods=["POST"], dependencies=authorized)
    app.add_api_route("/v1/responses/{response_id}", api.stored_response, methods=["GET", "DELETE"],
                      dependencies=authorized)
    app.add_api_route("/v1/responses/{response_id}/input_items", api.listed_input, methods=["GET"],
                      dependencies=authorized)
    app.add_api_route("/v1/responses/{response_id}/cancel", api.cancel, methods=["POST"], dependencies=authorized)
    app.add_api_route("/tokenize", api.tokenize, methods=["POST"], dependencies=authorized)       # vLLM's
    app.add_api_route("/detokenize", api.detokenize, methods=["POST"], dependencies=authorized)
    return app


def _decoder(router: Router) -> Callable[[int], str]:
    return lambda token_id: router.tokenizer.decode([token_id], skip_special_tokens=False)


def _text_of(router: Router, skip_special: bool = True) -> Callable[[list[int]], str]:
    """Token IDs -> the text they add to an output (special tokens left out where the router's text leaves them)."""
    return lambda ids: router.tokenizer.decode(ids, skip_special_tokens=skip_special)


def check_model(body: SamplingBody, served: str) -> str:
    if body.model != served:
        raise ApiError(404, f"The model `{body.model}` does not exist (this server serves `{served}`)", "model",
                       code="model_not_found")
    return served


async def admit(router: Router, generates: list, body: SamplingBody) -> list:
    """The router's states of the body's n choices of each prompt, prompt by prompt (a 400 for an invalid
    request)."""
    states = []
    try:
        for index, generate in enumerate(generates):
            try:
                states += [await router.admit(with_seed(generate, i), body.stream) for i in range(body.n)]
            except RequestError as exc:
                raise in_batch(exc, index) if len(generates) > 1 else exc
    except RequestError as exc:
        raise http_error(exc, body.params()) from exc
    return states


def reserved(router: Router, states: list) -> tuple:
    """A place in admission for each state, taken now (router.reserve): for all of them, or a 429 (none taken)."""
    taken = []
    try:
        for state in states:
            state.reservation = router.reserve()
            taken.append(state.reservation)
    except Overloaded as exc:
        for reservation in taken:
            reservation.release()
        raise failure(exc)[1] from exc
    return tuple(taken)


def in_batch(exc: RequestError, prompt: int) -> RequestError:
    """A refusal of a batch's prompt, saying which: `prompt[p]` (`prompt[p][i]` for its token i), or for another
    field, the prompt it was refused with."""
    detail = str(exc).removeprefix(f"{exc.field}: ")
    if exc.field.startswith("prompt"):
        return RequestError(f"prompt[{prompt}]" + exc.field[len(exc.field.split("[")[0]):], detail)
    return RequestError(exc.field, f"{detail} (with prompt {prompt} of the batch)")


def client_request(request: Request) -> ClientRequest:
    """The HTTP request as the request log sees it (Router.ended): made once, kept on the request's state."""
    if not hasattr(request.state, "client_request"):
        peer = f"{request.client.host}:{request.client.port}" if request.client else ""
        request.state.client_request = ClientRequest(request.url.path, peer)
    return request.state.client_request


def request_id_header(request: Request) -> str:
    """The client's X-Request-Id, as vLLM takes it ("" without one): the response's id is then the kind's prefix
    and it, and the header comes back on the response, so that a client's id finds its line in the request log."""
    value = request.headers.get("x-request-id", "")
    if len(value) > MAX_REQUEST_ID_CHARS:
        raise ApiError(400, f"X-Request-Id: must be at most {MAX_REQUEST_ID_CHARS} characters (got {len(value)})",
                       "X-Request-Id")
    return value


async def prepared(request: Request, router: Router, body: SamplingBody, generates: list,
                   kind: Completions) -> tuple[ClientRequest, str, AsyncIterator]:
    """Admit a request's choices (a 400 for an invalid one) and bind them to `kind`: its request log entry, its
    X-Request-Id (the client's, or one made for it) and its choices' chunks."""
    client, given = client_request(request), request_id_header(request)
    client.request_id = kind.logged_id(given, given) if given else ""   # a refusal below is logged under it
    client.states, client.per_prompt = await admit(router, generates, body), body.n
    kind.bind(client.states, body.prompt_logprobs, body.n)
    request_id = given or uuid.uuid4().hex
    client.request_id = kind.logged_id(request_id, given)       # the "id" its client sees
    return client, request_id, choice_chunks(router, client.states, router.config.router.max_active_requests)


async def answer(request: Request, router: Router, body: SamplingBody, generates: list, kind: Completions,
                 model: str) -> Response:
    client, request_id, chunks = await prepared(request, router, body, generates, kind)
    states = client.states
    headers = {"X-Request-Id": request_id}
    if body.stream:
        first = await until_disconnected(request, tracked(router, next_chunk(chunks), client, final=False))
        usage_on = "every chunk" if body.continuous_usage else "last" if body.include_usage else ""
        return StreamingResponse(sse(router, client, chunks, first, kind.events(request_id, model, usage_on)),
                                 media_type="text/event-stream", headers=headers)
    texts, entries = [[] for _ in states], [[] for _ in states]

    async def collect():
        async for index, chunk in chunks:
            texts[index].append(chunk.text)
            entries[index].extend(chunk.logprobs)
    await until_disconnected(request, tracked(router, collect(), client))
    logprobs = [e if generates[0].HasField("logprobs") else None for e in entries]
    choices = [kind.choice(i, "".join(texts[i]), logprobs[i], FINISH.get(s.finish_reason))
               for i, s in enumerate(states)]
    return JSONResponse(kind.whole(request_id, model, choices), headers=headers)


async def beam_answer(request: Request, router: Router, body: SamplingBody, generates: list, kind: Completions,
                      model: str) -> Response:
    """use_beam_search: each prompt's n best beams as its n choices, best first, read whole (openai_api/beam_search.py;
    the body passed beam_search.check)."""
    client, given = client_request(request), request_id_header(request)
    client.request_id = kind.logged_id(given, given) if given else ""
    client.states, client.per_prompt = (await admit(router, generates, body))[::body.n], 1    # validated, never run
    request_id = given or uuid.uuid4().hex
    client.request_id = kind.logged_id(request_id, given)

    async def searched() -> list:
        beams = [state for base in client.states for state in await beam_search.beam_states(router, body, base)]
        client.states, client.per_prompt = beams, body.n
        return beams
    states = await until_disconnected(request, tracked(router, searched(), client))
    kind.bind(states, None, body.n)
    text_of = _text_of(router, body.skip_special_tokens)
    choices = [kind.choice(i, text_of(state.tokens[state.prompt_len:]), None, FINISH.get(state.finish_reason))
               for i, state in enumerate(states)]
    return JSONResponse(kind.whole(request_id, model, choices), headers={"X-Request-Id": request_id})


async def choice_chunks(router: Router, states: list, at_once: int = 0) -> AsyncIterator[tuple]:
    """(choice index, Chunk) of the choices as they come, generated concurrently, at most `at_once` at a time (0:
    all): a batch larger than that runs in waves, the next choice started as one ends, so that a request alone
    never overfills admission (and holds one task per choice running, not per choice). Closing this cancels every
    choice still running (and so frees its workers' caches)."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, state) -> None:
        try:
            async with contextlib.aclosing(output_chunks(router.run(state), state, router.tokenizer)) as chunks:
                async for chunk in chunks:
                    await queue.put((index, chunk, None))
            await queue.put((index, None, None))
        except Exception as exc:  # noqa: BLE001 - handed to the consumer, which raises it
            await queue.put((index, None, exc))
    waiting, running = iter(enumerate(states)), {}

    def start_next(count: int) -> None:
        for index, state in itertools.islice(waiting, count):
            running[index] = asyncio.create_task(pump(index, state))
    start_next(at_once or len(states))
    try:
        while running:
            index, chunk, error = await queue.get()
            if error is not None:
                raise error
            if chunk is None:
                del running[index]
                start_next(1)
            else:
                yield index, chunk
    finally:
        for task in running.values():
            task.cancel()
        await asyncio.gather(*running.values(), return_exceptions=True)


async def next_chunk(chunks) -> tuple:
    """The next (index, Chunk), or (None, None) at the end. (anext's default argument trips a CPython 3.11
    bug, SystemError, when the generator ends after awaiting in its finally block.)"""
    try:
        return await anext(chunks)
    except StopAsyncIteration:
        return None, None


def failure(exc: BaseException) -> tuple[str, ApiError | None]:
    """The gRPC code a failed request is counted under, and the API error it answers (None: re-raise)."""
    if isinstance(exc, Overloaded):
        return "RESOURCE_EXHAUSTED", ApiError(429, str(exc), kind="rate_limit_exceeded")
    if isinstance(exc, grpc.aio.AioRpcError):
        code, detail = worker_failure(exc)
        return code, ApiError(503, detail, kind="service_unavailable", grpc_code=code)
    if isinstance(exc, (asyncio.CancelledError, GeneratorExit)):
        return "CANCELLED", None
    return "UNKNOWN", None


async def tracked(router: Router, awaitable, client: ClientRequest, final: bool = True):
    """Await a request's work, turning router errors into API errors (429 overload, 503 worker failure: ended
    where they are answered, Api.refused) and ending the request (Router.ended: counted under the gRPC code it
    would have had, and logged) once it is over (`final`), or if it ends otherwise (cancelled)."""
    try:
        result = await awaitable
    except BaseException as exc:
        code, error = failure(exc)
        if error is not None:
            raise error from exc
        router.ended(client, code)
        raise
    if final:
        router.ended(client, "OK")
    return result


async def until_disconnected(request: Request, awaitable, poll_s: float = 0.2):
    """Await `awaitable`, cancelling it if the client disconnects meanwhile (a plain HTTP response is not
    cancelled by the server when its client goes away), and then raising ClientDisconnected."""
    task, disconnected = asyncio.ensure_future(awaitable), False
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=poll_s)
            if not task.done() and await request.is_disconnected():
                task.cancel()
                disconnected = True
        return await task
    except asyncio.CancelledError:
        if disconnected and not asyncio.current_task().cancelling():      # not this handler's own cancellation
            raise ClientDisconnected from None
        raise
    finally:
        task.cancel()


async def sse(router: Router, client: ClientRequest, chunks, first: tuple | None, events) -> AsyncIterator[str]:
    """The stream's server-sent events, as `events` writes them (choices.ChoiceEvents, responses_api.ResponseEvents),
    its request ended once the output is over or has failed. `first`: the first chunk, if already awaited."""
    code, detail, failed = "OK", "", []
    try:
        async with contextlib.aclosing(chunks):
            for text in events.start():
                yield text
            index, chunk = first if first is not None else await next_chunk(chunks)
            while chunk is not None:
                for text in events.chunk(index, chunk):
                    yield text
                index, chunk = await next_chunk(chunks)
    except BaseException as exc:
        code, error = failure(exc)
        if error is None:
            raise
        detail, failed = str(error), events.failed(error)
    finally:
        router.ended(client, code, detail)
    for text in failed or events.end():
        yield text
