"""The gateway's requests in flight, by the id the client knows them by: what `Abort` looks up.

Client ids are scoped by tenant (`<key label>/<id>` with API keys on: hetero_common/tenancy.py).
A client id maps to the scheduler request ids submitted for it: a gRPC request is submitted
under its own id; an HTTP request with several prompts as `<id>-<i>`, one per prompt (its
client id is the HTTP request id, `X-Request-Id` when given). `register` adds ids under a
client id and `unregister` takes them off when their generation ends, so two requests that
happen to share a client id are each found. `aborted` holds the scheduler ids an Abort has
named, so that a generation whose Abort landed before its backend knew it still ends with
FINISH_REASON_ABORT at its next message.
"""

from __future__ import annotations

from typing import Callable


class ActiveRequests:
    def __init__(self) -> None:
        self._by_client: dict[str, set[str]] = {}
        self.aborted: set[str] = set()

    def __len__(self) -> int:
        return len(self._by_client)

    def register(self, client_id: str, scheduler_ids: list[str]) -> None:
        self._by_client.setdefault(client_id, set()).update(scheduler_ids)

    def unregister(self, client_id: str, scheduler_ids: list[str]) -> None:
        ids = self._by_client.get(client_id)
        if ids is not None:
            ids.difference_update(scheduler_ids)
            if not ids:
                del self._by_client[client_id]
        self.aborted.difference_update(scheduler_ids)

    def lookup(self, client_id: str) -> list[str]:
        """The scheduler ids in flight for this client id (empty: not known to this gateway)."""
        return sorted(self._by_client.get(client_id, ()))

    def lookup_any_tenant(self, client_id: str, unscoped: Callable[[str], str]) -> list[str]:
        """`lookup` over every tenant's namespace (an admin's abort): the ids of each scoped client id
        that `unscoped` maps to `client_id`. A scan, as admin aborts are rare."""
        return sorted(i for scoped, ids in self._by_client.items() if unscoped(scoped) == client_id for i in ids)

    def mark_aborted(self, scheduler_ids: list[str]) -> None:
        self.aborted.update(scheduler_ids)
