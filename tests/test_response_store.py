"""The Responses API's stored responses, in memory and in an SQLite file (http.store_path): the same bounds and
owners in both; a file's responses found by another store on it (a restarted router, or a second one on the
machine) as they were kept, a background response's events with it; a file that cannot be a store refused at start,
naming the key. The served Responses API runs on a file store in tests/test_responses_api.py."""
import asyncio
import itertools
import json
import types

import pytest

from openai_api.response_store import FileStore, ResponseStore, open_store
from openai_api.responses_api import FunctionCallItem, InputMessage, ReasoningItem
from settings.schema import ConfigError, HttpConfig


def message(text: str) -> InputMessage:
    return InputMessage(id=f"msg_{text}", role="user", content=text)


@pytest.fixture(params=["memory", "file"])
def make_store(request, tmp_path):
    """A new store of either kind with the given bounds (a file store in a file of its own)."""
    files = itertools.count()

    def make(capacity: int, max_chars: int = 2 ** 28):
        if request.param == "memory":
            return ResponseStore(capacity, max_chars)
        return FileStore(str(tmp_path / f"responses-{next(files)}.db"), capacity, max_chars)
    return make


def test_the_store_keeps_the_last_used_responses_within_its_bounds_without_logprobs(make_store):
    store = make_store(2, max_chars=10)
    for name in "abc":
        store.put({"id": name, "output": []}, [message(name)], 3)
        if name == "b":
            assert store.get("a").items == [message("a")]       # used: "b" is now the least recently used
    assert (store.get("b"), store.get("a").items, store.get("c").items, len(store)) == (
        None, [message("a")], [message("c")], 2)
    assert store.delete("a") and not store.delete("a") and (len(store), store.chars) == (1, 3)
    store.put({"id": "d", "output": []}, [message("d")], 8)            # 3 + 8 characters: "c" goes
    assert (store.get("c"), len(store), store.chars) == (None, 1, 8)
    store.put({"id": "e", "output": []}, [message("e")], 11)           # larger than the whole store: not kept
    assert (store.get("e"), store.get("d").items) == (None, [message("d")])
    store.put({"id": "d", "output": []}, [message("d2")], 2)           # stored again: replaced, counted once
    assert (store.get("d").items, len(store), store.chars) == ([message("d2")], 1, 2)
    part = {"type": "output_text", "text": "x", "logprobs": [{"token": "x", "logprob": -0.1}]}
    store.put({"id": "f", "output": [{"type": "message", "content": [part]}]}, [], 1)
    assert store.get("f").response["output"][0]["content"] == [{**part, "logprobs": []}]
    empty = make_store(0)
    empty.put({"id": "x", "output": []}, [], 0)
    assert len(empty) == 0 and empty.get("x") is None


def test_a_response_is_found_only_by_its_owner(make_store):
    store = make_store(4)
    store.put({"id": "r", "output": []}, [message("a")], 1, owner="key-a")
    assert store.get("r") is None and store.get("r", "key-b") is None and not store.delete("r", "key-b")
    assert store.get("r", "key-a").owner == "key-a" and store.delete("r", "key-a")


def test_a_file_stores_responses_are_found_by_another_store_on_it_as_they_were_kept(tmp_path):
    """What a restarted router, or a second router naming the same file, finds: the Response, its conversation's
    items of every kind with their types, how many were its input, its size and owner; the bounds hold across
    them (the last used by either is kept), and a deletion by one is gone for the other."""
    path = str(tmp_path / "responses.db")
    first = FileStore(path, capacity=2)
    items = [message("a"), ReasoningItem(type="reasoning", id="rs_1", summary=[],
                                         content=[{"type": "reasoning_text", "text": "think"}]),
             FunctionCallItem(type="function_call", id="fc_1", call_id="call_1", name="f", arguments='{"x": 1}'),
             InputMessage(id="msg_2", role="assistant", content=[{"type": "output_text", "text": "done"}])]
    response = {"id": "resp_1", "status": "completed", "output": [{"type": "message", "content": []}]}
    first.put(response, items, 17, owner="key-a", inputs=3)
    second = FileStore(path, capacity=2)
    found = second.get("resp_1", "key-a")
    assert (found.response, found.items, found.size, found.inputs, found.run) == (response, items, 17, 3, None)
    assert [type(item) for item in found.items] == [InputMessage, ReasoningItem, FunctionCallItem, InputMessage]
    second.put({"id": "resp_2", "output": []}, [message("b")], 1)
    assert first.get("resp_1", "key-a") is not None               # resp_1 is now the later used of the two
    first.put({"id": "resp_3", "output": []}, [message("c")], 1)
    assert (second.get("resp_2"), len(second)) == (None, 2)
    assert second.delete("resp_1", "key-a") and first.get("resp_1", "key-a") is None
    first.close()
    assert FileStore(path, capacity=2).get("resp_3").items == [message("c")]      # after a restart too


def test_a_background_responses_events_are_streamed_again_from_another_store(tmp_path):
    """A background response over is stored with its events: found on another store of the file, it is over, its
    events stream again from any one, and cancelling it answers it as it ended."""
    from openai_api.background import BackgroundRun
    path = str(tmp_path / "responses.db")
    final = {"id": "resp_1", "status": "completed", "output": []}
    log = [f"event: e{i}\ndata: {{}}\n\n" for i in range(4)]
    FileStore(path, capacity=4).put(final, [message("a")], 5, run=BackgroundRun.finished(log, final))
    run = FileStore(path, capacity=4).get("resp_1").run

    async def replay(after: int) -> list[str]:
        return [event async for event in run.follow(after)]
    assert run.over and run.current() == final
    assert asyncio.run(replay(-1)) == log and asyncio.run(replay(1)) == log[2:]
    assert asyncio.run(run.cancel()) == final


def test_a_file_that_cannot_be_a_store_fails_the_start_naming_the_key(tmp_path):
    not_a_database = tmp_path / "notes.txt"
    not_a_database.write_text("not a database, but long enough for SQLite to read its header " * 4)
    with pytest.raises(ConfigError, match=r"^http\.store_path: cannot keep responses in .*notes\.txt"):
        open_store(HttpConfig(store_path=str(not_a_database)))
    with pytest.raises(ConfigError, match=r"^http\.store_path: no such directory"):
        HttpConfig(store_path=str(tmp_path / "missing" / "responses.db")).validate()
    assert type(open_store(HttpConfig())) is ResponseStore
    assert type(open_store(HttpConfig(store_path=str(tmp_path / "responses.db")))) is FileStore


def test_a_restarted_router_continues_and_serves_a_response_stored_before(tmp_path):
    """Through the API's own handlers (no service): a response stored by one router's Api is continued by
    previous_response_id and retrieved by another Api on the same file, and a missing id's 404 says where."""
    from openai_api.app import Api
    from openai_api.protocol import ApiError
    from openai_api.responses_api import ResponsesRequest
    http = HttpConfig(store_path=str(tmp_path / "responses.db"))
    request = types.SimpleNamespace(headers={}, method="GET")
    response = {"id": "resp_1", "status": "completed", "output": []}
    Api(http, lambda: None).stored.put(response, [message("x")], 1)
    restarted = Api(http, lambda: None)
    assert json.loads(asyncio.run(restarted.stored_response("resp_1", request)).body) == response
    continuing = ResponsesRequest.model_validate({"model": "m", "input": "y", "previous_response_id": "resp_1"})
    assert [item.content for item in restarted.conversation(continuing, "")] == ["x", "y"]
    with pytest.raises(ApiError) as missing:
        asyncio.run(restarted.stored_response("resp_2", request))
    assert missing.value.status == 404 and "this server's store keeps the last 1000 used" in str(missing.value)


def test_a_store_that_cannot_write_logs_it_and_keeps_nothing_and_an_unreadable_row_is_forgotten(tmp_path, capsys,
                                                                                                monkeypatch):
    """A write another router holds the file past BUSY_S for fails: logged, the response not kept, the request
    not failed. A row this code cannot read back (a later layout's items) is logged and forgotten, not a 500."""
    import sqlite3
    monkeypatch.setattr(FileStore, "BUSY_S", 0.05)
    path = str(tmp_path / "responses.db")
    store = FileStore(path, capacity=4)
    other = sqlite3.connect(path, isolation_level=None)
    other.execute("BEGIN IMMEDIATE")                       # another router's write in progress
    store.put({"id": "resp_1", "output": []}, [message("a")], 1)
    other.execute("ROLLBACK")
    assert store.get("resp_1") is None and len(store) == 0
    assert "storing resp_1 failed (database is locked)" in capsys.readouterr().out
    store.put({"id": "resp_2", "output": []}, [message("b")], 1)
    other.execute("UPDATE responses SET items = '[{\"type\": \"a kind of later\"}]' WHERE id = 'resp_2'")
    assert store.get("resp_2") is None and len(store) == 0
    assert "resp_2 cannot be read back, forgotten" in capsys.readouterr().out


def test_a_file_of_another_layout_is_refused_and_a_store_keeping_none_keeps_no_file(tmp_path):
    import sqlite3
    path = tmp_path / "responses.db"
    FileStore(str(path), capacity=4).close()
    sqlite3.connect(path, isolation_level=None).execute("PRAGMA user_version = 7")
    with pytest.raises(ConfigError, match="its layout is version 7; this specpool reads 1"):
        open_store(HttpConfig(store_path=str(path)))
    assert type(open_store(HttpConfig(store_path=str(tmp_path / "none.db"), store_responses=0))) is ResponseStore
    assert not (tmp_path / "none.db").exists()
