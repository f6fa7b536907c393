"""The claim board: episodes the worker offers to external harnesses (POST /v1/episodes).

    offer(eid, info, execute, deadline_s)  the worker leased a task and opened its episode (workspace
                                           reset, recorder open): it waits here, first come first served
    claim(wait_s) -> Offer | None          a harness takes the oldest unclaimed offer; its deadline
                                           starts now (expires_at)
    withdraw(eid)                          no longer offered (ended, expired, the worker let go)
    retire(eid, status, message, result)   remembered (bounded): a later call naming the episode gets
                                           `status` and `message` (409 ended, 410 expired) instead of
                                           a 404 or, worse, a fresh ad-hoc episode of the same id

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


class ClaimBoard:
    def __init__(self) -> None:
        self.enabled = False  # the worker's [worker.harness] kind = "external"
        self.offers: dict[str, Offer] = {}
        self._ready: collections.deque[Offer] = collections.deque()
        self._changed = asyncio.Event()
        self._retired: collections.OrderedDict[str, ClaimError] = collections.OrderedDict()
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

    async def claim(self, wait_s: float) -> Offer | None:
        """The oldest unclaimed offer, waiting up to wait_s for one (None: none came)."""
        end = time.monotonic() + wait_s
        while True:
            while self._ready:
                o = self._ready.popleft()
                if not o.withdrawn:
                    o.expires_at = time.time() + o.deadline_s
                    o.claimed.set()
                    self.stats["claimed"] += 1
                    return o
            self._changed.clear()
            left = end - time.monotonic()
            if left <= 0:
                return None
            try:
                await asyncio.wait_for(self._changed.wait(), left)
            except TimeoutError:
                return None

    def get(self, episode_id: str) -> Offer | None:
        return self.offers.get(episode_id)

    def withdraw(self, episode_id: str) -> None:
        o = self.offers.pop(episode_id, None)
        if o is not None:
            o.withdrawn = True  # (left in _ready if unclaimed: claim() skips it)
            self.stats["withdrawn"] += 1

    def retire(self, episode_id: str, status: int, message: str, result: dict | None = None) -> None:
        self.withdraw(episode_id)
        self._retired[episode_id] = ClaimError(status, message, result)
        while len(self._retired) > KEEP_RETIRED:
            self._retired.popitem(last=False)

    def retired(self, episode_id: str) -> ClaimError | None:
        return self._retired.get(episode_id)
