"""The Responses API's stored responses (`http.store_responses`, `http.store_responses_mb`): the last ones asked to
be stored (`store`, true by default), least recently used first out, at most so many and so much text. What
`previous_response_id` continues and `GET /v1/responses/{id}` returns, to the API key that stored it only (its
owner). A stored response keeps no logprobs (their alternatives would cost ~8 KB a token). A background response is
held while it runs (never forgotten for room then: admission bounds how many run), and stored with its events once
over.

Where they are kept (`http.store_path`): in this router's memory (ResponseStore, the default: a restarted router, or
another one behind a load balancer, has none of them), or in an SQLite database file (FileStore), kept over restarts
and shared by the routers that name the same file on one machine. A background response still running is found
only on the router running it; once over, on every router sharing the file.

    http: {port: 8000, store_path: /var/lib/specpool/responses.db}
"""
from __future__ import annotations

import json
import sqlite3
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable

from pydantic import TypeAdapter

from openai_api.background import BackgroundRun
from openai_api.responses_api import Item, without_logprobs
from router.oplog import say
from settings.schema import ConfigError, HttpConfig


@dataclass(frozen=True)
class Stored:
    response: dict          # the Response, as answered, without its logprobs
    items: list             # its conversation as input items: its input (and its previous response's), its output
    size: int               # characters of text they hold, what the bound counts
    owner: str = ""         # who may find it (Api.owner: its API key's digest; "" without keys)
    inputs: int = 0         # how many of the items it was given (the rest are its output)
    run: Any = None         # a background response's run (openai_api/background.py: its events, its state)


class Store:
    """What both stores share: the bounds, the owners, and the background responses this router runs, held until
    they are over. Where the rest is kept is a subclass's (_keep, _find, _touch, _forget, chars, __len__)."""

    def __init__(self, capacity: int, max_chars: int = 2 ** 28):
        self.capacity, self.max_chars = capacity, max_chars
        self._running: dict[str, Stored] = {}       # background responses, until they are over (and put)

    def hold(self, response_id: str, running: Stored) -> None:
        """Find a background response while it runs (outside the bounds, until it is put)."""
        self._running[response_id] = running

    def running(self) -> list[Stored]:
        return list(self._running.values())

    def put(self, response: dict, items: list, size: int, owner: str = "", inputs: int = 0, run: Any = None) -> None:
        """Keep `response` for `owner` (not one larger than the whole store), its conversation `items` (the first
        `inputs` of them its input), forgetting the least recently used past the bounds."""
        self._running.pop(response["id"], None)
        if self.capacity > 0 and size <= self.max_chars:
            self._keep(Stored(without_logprobs(response), items, size, owner, inputs, run))

    def get(self, response_id: str, owner: str = "") -> Stored | None:
        """The response stored (or running) as `response_id`, if `owner` stored it (another's is not there for it)."""
        stored = self._running.get(response_id) or self._find(response_id)
        if stored is None or stored.owner != owner:
            return None
        if response_id not in self._running:
            self._touch(response_id)
        return stored

    def delete(self, response_id: str, owner: str = "") -> bool:
        if self.get(response_id, owner) is None:
            return False
        self._running.pop(response_id, None)
        self._forget(response_id)
        return True


class ResponseStore(Store):
    """Stored responses in this router's memory."""

    def __init__(self, capacity: int, max_chars: int = 2 ** 28):
        super().__init__(capacity, max_chars)
        self._stored: OrderedDict[str, Stored] = OrderedDict()
        self._chars = 0

    @property
    def chars(self) -> int:
        """Characters of text the stored responses hold (what store_responses_mb bounds)."""
        return self._chars

    def __len__(self) -> int:
        return len(self._stored)

    def _keep(self, stored: Stored) -> None:
        self._forget(stored.response["id"])
        self._stored[stored.response["id"]] = stored
        self._chars += stored.size
        while len(self._stored) > self.capacity or self._chars > self.max_chars:
            self._chars -= self._stored.popitem(last=False)[1].size

    def _find(self, response_id: str) -> Stored | None:
        return self._stored.get(response_id)

    def _touch(self, response_id: str) -> None:
        self._stored.move_to_end(response_id)

    def _forget(self, response_id: str) -> None:
        if response_id in self._stored:
            self._chars -= self._stored.pop(response_id).size


ITEM_LIST = TypeAdapter(list[Item])       # a stored conversation's items, to JSON and back
VERSION = 1                              # the file's layout (PRAGMA user_version); another version is refused
SCHEMA = ("""CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY, owner TEXT NOT NULL, used INTEGER NOT NULL, size INTEGER NOT NULL, inputs INTEGER NOT NULL,
    response TEXT NOT NULL, items TEXT NOT NULL, events TEXT)""",
          "CREATE INDEX IF NOT EXISTS responses_used ON responses (used)",
          # how many are stored and their size, kept by triggers, so that a bound is checked without a scan
          "CREATE TABLE IF NOT EXISTS totals (count INTEGER NOT NULL, chars INTEGER NOT NULL)",
          "INSERT INTO totals SELECT 0, 0 WHERE NOT EXISTS (SELECT 1 FROM totals)",
          """CREATE TRIGGER IF NOT EXISTS stored AFTER INSERT ON responses
             BEGIN UPDATE totals SET count = count + 1, chars = chars + new.size; END""",
          """CREATE TRIGGER IF NOT EXISTS restored AFTER UPDATE OF size ON responses
             BEGIN UPDATE totals SET chars = chars + new.size - old.size; END""",
          """CREATE TRIGGER IF NOT EXISTS forgotten AFTER DELETE ON responses
             BEGIN UPDATE totals SET count = count - 1, chars = chars - old.size; END""",
          f"PRAGMA user_version = {VERSION}")
NEXT_USE = "(SELECT COALESCE(MAX(used), 0) + 1 FROM responses)"   # the order of use, shared by the routers (no clock)
UPSERT = f"""INSERT INTO responses VALUES (?, ?, {NEXT_USE}, ?, ?, ?, ?, ?) ON CONFLICT (id) DO UPDATE SET
    owner = excluded.owner, used = excluded.used, size = excluded.size, inputs = excluded.inputs,
    response = excluded.response, items = excluded.items, events = excluded.events"""


class FileStore(Store):
    """Stored responses in an SQLite database file (http.store_path), created if missing: kept over a restart, and
    shared by the routers on this machine that name the same file (WAL mode; each write one short transaction, on
    the event loop, waiting at most BUSY_S for another router's). Bounded as the memory store is, the last used by
    any of them kept. A background response's events are kept with it, so it streams again
    (BackgroundRun.finished) wherever it is found. The store never fails a request: a write that fails is logged
    and the response is not kept, and a row that cannot be read back is forgotten."""
    BUSY_S = 2.0

    def __init__(self, path: str, capacity: int, max_chars: int = 2 ** 28):
        super().__init__(capacity, max_chars)
        self.path = path
        self._db = sqlite3.connect(path, timeout=self.BUSY_S, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        version = self._db.execute("PRAGMA user_version").fetchone()[0]
        if version not in (0, VERSION):
            raise sqlite3.DatabaseError(f"its layout is version {version}; this specpool reads {VERSION}")
        with self._db:
            for statement in SCHEMA:
                self._db.execute(statement)

    @property
    def chars(self) -> int:
        return self._db.execute("SELECT chars FROM totals").fetchone()[0]

    def __len__(self) -> int:
        return self._db.execute("SELECT count FROM totals").fetchone()[0]

    def close(self) -> None:
        self._db.close()

    def _write(self, what: str, write: Callable[[sqlite3.Connection], Any]) -> None:
        """Run `write` in one transaction; a failure (e.g. locked past BUSY_S, a full disk) is logged, never raised:
        a response not kept is what the bounds could have made of it anyway."""
        try:
            with self._db:
                write(self._db)
        except sqlite3.Error as exc:
            say(f"response store {self.path}: {what} failed ({exc})")

    def _keep(self, stored: Stored) -> None:
        events = json.dumps(stored.run.log) if stored.run is not None else None
        row = (stored.response["id"], stored.owner, stored.size, stored.inputs, json.dumps(stored.response),
               ITEM_LIST.dump_json(stored.items).decode(), events)

        def write(db: sqlite3.Connection) -> None:
            db.execute(UPSERT, row)
            count, chars = db.execute("SELECT count, chars FROM totals").fetchone()
            while count > self.capacity or chars > self.max_chars:      # the least recently used go
                oldest, size = db.execute("SELECT id, size FROM responses ORDER BY used LIMIT 1").fetchone()
                db.execute("DELETE FROM responses WHERE id = ?", (oldest,))
                count, chars = count - 1, chars - size
        self._write(f"storing {stored.response['id']}", write)

    def _find(self, response_id: str) -> Stored | None:
        row = self._db.execute("SELECT owner, size, inputs, response, items, events FROM responses WHERE id = ?",
                               (response_id,)).fetchone()
        if row is None:
            return None
        owner, size, inputs, response, items, events = row
        try:
            response = json.loads(response)
            run = BackgroundRun.finished(json.loads(events), response) if events is not None else None
            return Stored(response, ITEM_LIST.validate_json(items), size, owner, inputs, run)
        except ValueError as exc:               # a row this code cannot read (pydantic's errors are ValueErrors)
            say(f"response store {self.path}: {response_id} cannot be read back, forgotten ({exc!r:.200})")
            self._forget(response_id)
            return None

    def _touch(self, response_id: str) -> None:
        self._write(f"using {response_id}",
                    lambda db: db.execute(f"UPDATE responses SET used = {NEXT_USE} WHERE id = ?", (response_id,)))

    def _forget(self, response_id: str) -> None:
        self._write(f"forgetting {response_id}",
                    lambda db: db.execute("DELETE FROM responses WHERE id = ?", (response_id,)))


def open_store(http: HttpConfig) -> Store:
    """The store `http` asks for: in memory (also for store_responses 0: none kept, none found), or in the SQLite
    file http.store_path (a file that cannot be opened as one, e.g. not a database, not writable or of another
    layout, fails serve's start, naming the key)."""
    bounds = (http.store_responses, http.store_responses_mb * 2 ** 20)
    if not http.store_path or http.store_responses == 0:
        return ResponseStore(*bounds)
    try:
        return FileStore(http.store_path, *bounds)
    except sqlite3.Error as exc:
        raise ConfigError(f"http.store_path: cannot keep responses in {http.store_path!r} ({exc})") from exc
