"""Answers handed to gRPC and not yet received by their clients, by connection: a client that stops
reading its answers is refused new requests before it makes the server hold more of them.

gRPC holds a unary call's answer until HTTP/2 flow control lets its last byte out, which a client that
sends requests and never reads never does: 200 requests asking for 8 MiB of weights each, from one such
client, grew the server to 5.5 GiB resident for as long as the connection lived (BENCHMARKS.md, fifty-eighth
pass). Here a unary call's answer counts, at the size its request asks for, from the request's admission
until the call ends (gRPC's done callback comes once the answer's bytes have left, or once the call was
cancelled or its connection closed): a burst of requests counts before any of it is computed.

A stream's answers have no done callback each: one counts from its request's admission until it has been
computed, then at its size on the wire until the stream has sent it (gRPC resumes the stream's handler
once an answer has gone out). Four streams that sent 200 requests each and read nothing made the server
hold 6 GiB before: their `stream_window` of 128 answers each.

Once the answers owed on this process reach `limit`, a request is refused (RESOURCE_EXHAUSTED; in band on
a stream) if its connection is owed at least an even share of the limit among the connections owed any:
the clients that hold the most are refused, and a client that reads its answers is served on. A connection
owed nothing is always served then, so that many connections, each with one answer unread, could still
pile up answers without bound: at twice the limit every request is refused until answers go out.
"""

from __future__ import annotations

import grpc

from attnserve_server.edge.registration import Emptied
from attnserve_server.errors import UnsentAnswers, size_text

# What a call costs gRPC and the handler while it lasts, counted with its answer: 5,000 calls open at once
# took 90 MiB (BENCHMARKS.md, fifty-eighth pass), so that many small answers are bounded too.
CALL_BYTES = 16 << 10


class Outbox:
    """Bytes of answers owed (being computed, or sent and not yet read), in all and per connection (gRPC's
    peer address). Used on the event loop."""

    def __init__(self, limit: int) -> None:
        self.limit = limit  # 0: no limit, nothing counted
        self.total = 0
        self._held: dict[str, int] = {}  # peer -> bytes
        self._sent = Emptied()

    @property
    def connections(self) -> int:
        """How many connections are owed answers."""
        return len(self._held)

    def admit(self, peer: str) -> None:
        """Raises UnsentAnswers when the process owes `limit` or more and the connection `peer` is owed an
        even share of it or more, or when it owes twice `limit`."""
        if self.total < self.limit or not self.limit:  # the usual case
            return
        held = self._held.get(peer, 0)
        if held and held >= self.limit / len(self._held):
            raise UnsentAnswers(
                f"answers: the server owes this connection {size_text(held)} of answers (computing, or sent and not "
                f"yet read by its client) and {size_text(self.total)} to all, at its max_unsent_bytes "
                f"{size_text(self.limit)}: read the answers already sent before sending more requests"
            )
        if self.total >= 2 * self.limit:
            raise UnsentAnswers(
                f"answers: the server owes {size_text(self.total)} of answers (computing, or sent and not yet read) "
                f"over {len(self._held)} connections, twice its max_unsent_bytes {size_text(self.limit)}: it takes "
                "no request until its clients read; retry later"
            )

    def owe_call(self, context: grpc.aio.ServicerContext, peer: str, answer_bytes: int) -> None:
        """A unary call's answer of `answer_bytes`, and the call itself, owed to `peer` until the call ends."""
        if self.limit:
            nbytes = answer_bytes + CALL_BYTES
            self.owe(peer, nbytes)
            context.add_done_callback(lambda _: self.release(peer, nbytes))

    def owe(self, peer: str, nbytes: int) -> None:
        self._held[peer] = self._held.get(peer, 0) + nbytes
        self.total += nbytes

    def release(self, peer: str, nbytes: int) -> None:
        self.total -= nbytes
        left = self._held[peer] - nbytes
        if left:
            self._held[peer] = left
        else:
            del self._held[peer]
            if not self._held:
                self._sent.reached()

    async def sent(self, timeout_s: float) -> bool:
        """Waits until nothing is owed (True), or `timeout_s` (False): at shutdown, answers computed go
        out to clients that read them within the grace period. Nothing is counted without a limit."""
        return await self._sent.wait(bool(self._held), timeout_s)
