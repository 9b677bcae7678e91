"""The Responses API's stored responses (`http.store_responses`, `http.store_responses_mb`): the last ones asked to
be stored (`store`, true by default), in this router's memory, least recently used first out, at most so many and
so much text. What `previous_response_id` continues and `GET /v1/responses/{id}` returns, to the API key that stored
it only (its owner). A restarted router, or another one behind a load balancer, has none of them. A stored response
keeps no logprobs (their alternatives would cost ~8 KB a token). A background response is held while it runs
(never forgotten for room then: admission bounds how many run), and stored with its events once over."""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Stored:
    response: dict          # the Response, as answered, without its logprobs
    items: list             # its conversation as input items: its input (and its previous response's), its output
    size: int               # characters of text they hold, what the bound counts
    owner: str = ""         # who may find it (Api.owner: its API key's digest; "" without keys)
    inputs: int = 0         # how many of the items it was given (the rest are its output)
    run: Any = None         # a background response's run (openai_api/background.py: its events, its state)


def without_logprobs(response: dict) -> dict:
    output = [{**item, "content": [{**part, "logprobs": []} if part["type"] == "output_text" else part
                                   for part in item["content"]]} if "content" in item else item
              for item in response["output"]]
    return {**response, "output": output}


class ResponseStore:
    def __init__(self, capacity: int, max_chars: int = 2 ** 28):
        self.capacity, self.max_chars = capacity, max_chars
        self._stored: OrderedDict[str, Stored] = OrderedDict()
        self._running: dict[str, Stored] = {}       # background responses, until they are over (and put)
        self.chars = 0

    def hold(self, response_id: str, running: Stored) -> None:
        """Find a background response while it runs (outside the bounds, until it is put)."""
        self._running[response_id] = running

    def running(self) -> list[Stored]:
        return list(self._running.values())

    def put(self, response: dict, items: list, size: int, owner: str = "", inputs: int = 0, run: Any = None) -> None:
        """Keep `response` for `owner` (not one larger than the whole store), its conversation `items` (the first
        `inputs` of them its input), forgetting the least recently used past the bounds."""
        self._running.pop(response["id"], None)
        if self.capacity <= 0 or size > self.max_chars:
            return
        replaced = self._stored.pop(response["id"], None)
        self.chars -= replaced.size if replaced is not None else 0
        self._stored[response["id"]] = Stored(without_logprobs(response), items, size, owner, inputs, run)
        self.chars += size
        while len(self._stored) > self.capacity or self.chars > self.max_chars:
            self.chars -= self._stored.popitem(last=False)[1].size

    def get(self, response_id: str, owner: str = "") -> Stored | None:
        """The response stored (or running) as `response_id`, if `owner` stored it (another's is not there for it)."""
        stored = self._running.get(response_id) or self._stored.get(response_id)
        if stored is None or stored.owner != owner:
            return None
        if response_id in self._stored:
            self._stored.move_to_end(response_id)
        return stored

    def delete(self, response_id: str, owner: str = "") -> bool:
        if self.get(response_id, owner) is None:
            return False
        self._running.pop(response_id, None)
        if response_id in self._stored:
            self.chars -= self._stored.pop(response_id).size
        return True

    def __len__(self) -> int:
        return len(self._stored)
