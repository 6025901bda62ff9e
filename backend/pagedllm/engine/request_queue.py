"""Waiting queues: FCFS (arrival order) and priority (lower value first, ties by arrival)."""

from __future__ import annotations

import heapq
import itertools
from collections import deque

from pagedllm.engine.request import Request


class FCFSQueue:
    def __init__(self) -> None:
        self._q: deque[Request] = deque()

    def add(self, req: Request) -> None:
        self._q.append(req)

    def add_front(self, req: Request) -> None:
        """Preempted requests go back to the front: they were admitted before anything still waiting."""
        self._q.appendleft(req)

    def peek(self) -> Request:
        return self._q[0]

    def pop(self) -> Request:
        return self._q.popleft()

    def remove(self, req: Request) -> None:
        self._q.remove(req)

    def __len__(self) -> int:
        return len(self._q)

    def __iter__(self):
        return iter(list(self._q))


class PriorityQueue:
    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        self._tiebreak = itertools.count()

    def add(self, req: Request) -> None:
        heapq.heappush(self._heap, (req.priority, req.arrival_time, next(self._tiebreak), req))

    add_front = add  # a preempted request keeps its (priority, arrival) rank

    def peek(self) -> Request:
        return self._heap[0][3]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[3]

    def remove(self, req: Request) -> None:
        self._heap = [e for e in self._heap if e[3] is not req]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self):
        return iter([e[3] for e in sorted(self._heap)])


def make_queue(policy: str):
    return PriorityQueue() if policy == "priority" else FCFSQueue()
