"""The claim board: episodes the worker offers to external harnesses (POST /v1/episodes).

    offer(eid, info, execute, deadline_s)  the worker leased a task and opened its episode (workspace
                                           reset, recorder open): it waits here, first come first served
    claim(wait_s, alive) -> Offer | None   a harness reserves the oldest unclaimed offer (its
                                           deadline starts now: expires_at), while alive() (the
                                           caller is still connected; checked every POLL_S)
    confirm(offer) / release(offer)        the reply reached the caller: claimed (the runner's
                                           deadline runs) / it did not: first in line again
    withdraw(eid)                          no longer offered (ended, expired, the worker let go)
    retire(eid, status, message, result, owner)
                                           remembered (bounded): a later call of `owner` naming the
                                           episode gets `status` and `message` (409 ended, 410
                                           expired) instead of a 404 or, worse, a fresh ad-hoc
                                           episode of the same id

The board holds no task and no workspace: the runner that offered an episode (rollout_worker/
external.py) keeps the task's lease, plays the harness's commands through `execute`, scores and
publishes; the board only hands episodes out once each.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import time
from collections.abc import Awaitable, Callable

from .trajectory import RequestError

KEEP_RETIRED = 4096
POLL_S = 0.2  # how soon a waiting claim notices its caller hung up
ANY = object()


class ClaimError(RequestError):
    """An external-harness call the endpoint refuses, with its HTTP status."""

    def __init__(self, status: int, message: str, result: dict | None = None):
        super().__init__(message)
        self.status, self.result = status, result


@dataclasses.dataclass
class Offer:
    episode_id: str
    info: dict  # what the claimant gets (never the hidden tests)
    execute: Callable[[str], Awaitable[dict]]  # one command, one turn in the task's workspace
    deadline_s: float  # claim -> end, else the task is handed back
    claimed: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    expires_at: float = 0.0  # wall clock (time.time), set at the claim
    withdrawn: bool = False
    owner: str | None = None  # the claiming token (endpoint_token.owner_of): its calls only


class ClaimBoard:
    def __init__(self) -> None:
        self.enabled = False  # the worker's [worker.harness] kind = "external"
        self.offers: dict[str, Offer] = {}
        self._ready: collections.deque[Offer] = collections.deque()
        self._changed = asyncio.Event()
        self._retired: collections.OrderedDict[str, tuple[str | None, ClaimError]] = collections.OrderedDict()
        self.stats = {"offered": 0, "claimed": 0, "withdrawn": 0}

    def offer(self, episode_id: str, info: dict, execute, deadline_s: float) -> Offer:
        if episode_id in self.offers:
            raise ValueError(f"episode {episode_id!r} is already offered")
        o = Offer(episode_id, info, execute, deadline_s)
        self.offers[episode_id] = o
        self._ready.append(o)
        self.stats["offered"] += 1
        self._changed.set()
        return o

    async def claim(self, wait_s: float, alive: Callable[[], bool] = lambda: True) -> Offer | None:
        """The oldest unclaimed offer, reserved, waiting up to wait_s for one while alive() (None:
        none came, or the caller left). The caller confirm()s it once its reply is delivered, or
        release()s it."""
        end = time.monotonic() + wait_s
        while alive():
            while self._ready:
                o = self._ready.popleft()
                if not o.withdrawn:
                    o.expires_at = time.time() + o.deadline_s
                    return o
            self._changed.clear()
            left = end - time.monotonic()
            if left <= 0:
                return None
            try:
                await asyncio.wait_for(self._changed.wait(), min(left, POLL_S))
            except TimeoutError:
                pass
        return None

    def confirm(self, o: Offer) -> None:
        o.claimed.set()
        self.stats["claimed"] += 1

    def release(self, o: Offer) -> None:
        """A reserved offer whose reply never reached its caller: the next caller gets it."""
        o.owner, o.expires_at = None, 0.0
        if not o.withdrawn:
            self._ready.appendleft(o)
            self._changed.set()

    def get(self, episode_id: str) -> Offer | None:
        return self.offers.get(episode_id)

    def withdraw(self, episode_id: str) -> None:
        o = self.offers.pop(episode_id, None)
        if o is not None:
            o.withdrawn = True  # (left in _ready if unclaimed: claim() skips it)
            self.stats["withdrawn"] += 1

    def retire(
        self, episode_id: str, status: int, message: str, result: dict | None = None, owner=ANY
    ) -> None:
        """`owner`: whose calls learn of it (default: the offer's claimant)."""
        o = self.offers.get(episode_id)
        if owner is ANY:
            owner = o.owner if o is not None else None
        self.withdraw(episode_id)
        self._retired[episode_id] = (owner, ClaimError(status, message, result))
        while len(self._retired) > KEEP_RETIRED:
            self._retired.popitem(last=False)

    def retired(self, episode_id: str, owner=ANY) -> ClaimError | None:
        """How a retired episode answers `owner` (ANY: whoever); None if it is not retired, or
        another token's (that caller gets a 404, as for an id that never was)."""
        got = self._retired.get(episode_id)
        if got is None or (owner is not ANY and got[0] != owner):
            return None
        return got[1]
