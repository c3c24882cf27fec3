"""Stored Responses API answers (gateway.responses_api): what ``previous_response_id``
continues, ``GET`` / ``DELETE /v1/responses/{id}`` read and drop, and ``GET
/v1/responses/{id}/input_items`` pages through.

Choice made here: OpenAI stores a response unless ``store`` is false; vLLM keeps them only
behind an environment flag because its store grows without bound. This one is bounded — the
last ``capacity`` responses in memory, the least recently used dropped first (``specctl gateway
--responses-store N``; 0 keeps none) — so storing is on by default and memory stays flat. A
stored response keeps its body and its conversation as chat messages (without its
``instructions``: OpenAI does not carry them over to the next turn)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass

from specctl.gateway.api import ApiError, ChatMessage


@dataclass(slots=True, frozen=True)
class StoredResponse:
    body: dict
    conversation: tuple[ChatMessage, ...]  # the input turns and the answer, as the next turn continues them
    input_items: tuple[dict, ...] = ()  # this request's own input items (gateway.responses_api.input_records)


class ResponseStore:
    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"the responses store holds at least 0 responses, got {capacity}")
        self.capacity = capacity
        self._responses: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._responses)

    def put(self, stored: StoredResponse) -> None:
        if self.capacity == 0:
            return
        self._responses[stored.body["id"]] = stored
        self._responses.move_to_end(stored.body["id"])
        while len(self._responses) > self.capacity:
            self._responses.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        stored = self._responses.get(response_id)
        if stored is not None:
            self._responses.move_to_end(response_id)
        return stored

    def delete(self, response_id: str) -> bool:
        return self._responses.pop(response_id, None) is not None

    def history(self, previous_id: str | None) -> tuple[ChatMessage, ...]:
        """The conversation ``previous_response_id`` continues (none without one; a 400 for an
        id not held)."""
        if previous_id is None:
            return ()
        if self.capacity == 0:
            raise ApiError(400, "previous_response_id needs stored responses and this gateway keeps none "
                                "(--responses-store 0): send the whole conversation in input, or start the gateway "
                                "with --responses-store N", param="previous_response_id")
        stored = self.get(previous_id)
        if stored is None:
            raise ApiError(400, f"Previous response with id {previous_id!r} not found: it was not stored (store false), "
                                f"was deleted, or is older than the last {self.capacity} this gateway keeps",
                           param="previous_response_id", code="previous_response_not_found")
        return stored.conversation

    def read(self, response_id: str) -> dict:
        """GET /v1/responses/{id}: the stored body (a 404 for an id not held)."""
        stored = self.get(response_id)
        if stored is None:
            raise self._missing(response_id)
        return stored.body

    def remove(self, response_id: str) -> dict:
        """DELETE /v1/responses/{id}: OpenAI's deletion object (a 404 for an id not held)."""
        if not self.delete(response_id):
            raise self._missing(response_id)
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    def _missing(self, response_id: str) -> ApiError:
        return ApiError(404, f"No response found with id {response_id!r}: it was not stored, was deleted, or is older "
                             f"than the last {self.capacity} this gateway keeps", param="response_id",
                        code="response_not_found")

    def input_items(self, response_id: str, query: Mapping[str, str]) -> dict:
        """GET /v1/responses/{id}/input_items: a page of the stored response's own input items
        (OpenAI's ``order`` desc by default, ``limit`` 1-100, default 20, ``after`` an item id)."""
        stored = self.get(response_id)
        if stored is None:
            raise self._missing(response_id)
        order = query.get("order", "desc")
        if order not in ("asc", "desc"):
            raise ApiError(400, f"order must be 'asc' or 'desc', got {order!r}", param="order")
        try:
            limit = int(query.get("limit", "20"))
        except ValueError:
            limit = 0
        if not 1 <= limit <= 100:
            raise ApiError(400, f"limit must be an integer from 1 to 100, got {query.get('limit')!r}", param="limit")
        items = list(stored.input_items if order == "asc" else reversed(stored.input_items))
        after = query.get("after")
        if after is not None:
            ids = [item["id"] for item in items]
            if after not in ids:
                raise ApiError(400, f"after {after!r} is not an input item of {response_id!r}", param="after")
            items = items[ids.index(after) + 1:]
        page = items[:limit]
        return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit}
