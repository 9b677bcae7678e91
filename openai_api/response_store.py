"""The Responses API's stored responses (`http.store_responses`): the last ones asked to be stored (`store`, true
by default), in this router's memory, least recently used first out. What `previous_response_id` continues and
`GET /v1/responses/{id}` returns. A restarted router, or another one behind a load balancer, has none of them."""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass(frozen=True)
class Stored:
    response: dict          # the Response, as answered
    items: list             # its conversation as input items: its input (and its previous response's), its output


class ResponseStore:
    def __init__(self, capacity: int):
        self.capacity = capacity
        self._stored: OrderedDict[str, Stored] = OrderedDict()

    def put(self, response: dict, items: list) -> None:
        if self.capacity <= 0:
            return
        self._stored[response["id"]] = Stored(response, items)
        self._stored.move_to_end(response["id"])
        while len(self._stored) > self.capacity:
            self._stored.popitem(last=False)

    def get(self, response_id: str) -> Stored | None:
        stored = self._stored.get(response_id)
        if stored is not None:
            self._stored.move_to_end(response_id)
        return stored

    def delete(self, response_id: str) -> bool:
        return self._stored.pop(response_id, None) is not None

    def __len__(self) -> int:
        return len(self._stored)
