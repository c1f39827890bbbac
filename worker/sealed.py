"""The worker's sealed data connection (PROTOCOL.md §6.15; a mixin of :class:`worker.link.Worker`).

Under CurveZMQ a welcome may carry a session (protocol/seal.py): keys for each direction and a
token. The worker then opens a second connection to the same endpoint under ZMTP's NULL
mechanism, its routing id the token (the server's front lets it through only with a token of
that server), and seals a heartbeat on it at once. The worker speaks ZMTP on that connection
itself (worker/plainsock.py), with no libzmq I/O thread between it and the socket. The server
answers on it from that message on; once something opened there, everything but a hello goes
there too, each message's frames sealed with AES-256-GCM. A message the data connection cannot
take now goes over CurveZMQ, which the worker keeps reading: the server sends there while the
data connection is down.
"""

from __future__ import annotations

import logging

import zmq

from protocol.chunks import chunking
from protocol.codec import encode
from protocol.errors import RemoteProtocolError
from protocol.messages import MAX_PARTS, RECONNECT_IVL_MAX_S, RECONNECT_IVL_S, Heartbeat
from protocol.seal import EARLY_MIN, GCM, BufferPool, Opener, Sealer, Session, available_ciphers, sealer_opener
from worker.plainsock import ZmtpDealer
from worker.sockio import recv_frames, send_frames

_EVENTS, _POLLIN, _NOBLOCK = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.NOBLOCK)
log = logging.getLogger("latecomer.worker")


class SealedLink:
    """The sealed data connection's socket, its session and its loop steps."""

    def _init_seal(self) -> None:
        self.plain_chunking = chunking(False)  # how large replies are split on the data connection
        # the session's connection (a DEALER speaking ZMTP itself, worker/plainsock.py), its two
        # halves, and whether the server has sent on it (then everything but a hello goes there too)
        self.seal_sock: ZmtpDealer | None = None
        self.seal_token = b""  # the session's token
        self.seal_retry_at: float | None = None  # when to connect again (a connection that never came up)
        self.seal_retry_s = RECONNECT_IVL_S
        self.sealer: Sealer | None = None
        self.opener: Opener | None = None
        self.seal_up = False
        self.poll_seal_out = False  # the loop's poller waits to write on it (worker/link.py _poll)
        self.seal_pool = BufferPool()  # warm buffers for sealing and opening, and for what is read
        self.seal_refused = 0  # sealed messages that did not open (logged once per 10 s)
        self.seal_log_at = -1e9

    def _out(self, frames: list, sealed: bool) -> None:
        """One message out: sealed on the data connection, or over CurveZMQ (also when the data
        connection's queue is full: the server reads both)."""
        s = self.seal_sock
        if sealed and s is not None and s.lost is None and s.queued < s.max_queued:
            s.send(self.sealer.seal(frames))  # cannot be Full: checked above, one thread
            return
        send_frames(self.sock, frames, _NOBLOCK)

    def _open_seal(self, hexed: str, segments: bool = False, cipher: str = GCM) -> None:
        """A welcome's session (PROTOCOL.md §6.15): a NULL ZMTP connection to the same endpoint as
        a DEALER, its routing id the session's token, and a heartbeat sealed on it at once (it
        goes once the handshake is done): the server answers on it from that message on, and this
        worker sends there once something came. ``segments``: the server opens frames sealed in
        segments (welcome.seal_segments); ``cipher``: the session's (welcome.seal_cipher, one the hello offered)."""
        self._close_seal()
        if not hexed or self.curve is None:
            return
        if cipher not in available_ciphers():  # not one the hello offered: stay on CurveZMQ
            log.warning("the server chose seal cipher %s, which this worker cannot use: staying on CurveZMQ", cipher)
            return
        session = Session.unpack(bytes.fromhex(hexed))
        self.sealer, self.opener = sealer_opener(session, server=False, alloc=self.seal_pool, segments=segments,
                                                 cipher=cipher)
        self.opener.in_place = True  # the data connection reads large frames into buffers of our own, once
        self.seal_token, self.seal_retry_s = session.token, RECONNECT_IVL_S
        self._connect_seal()

    def _connect_seal(self) -> None:
        """The session's data connection (again), with a sealed heartbeat queued on it."""
        self.seal_retry_at = None
        try:
            s = ZmtpDealer(self.cfg.server, self.seal_token, alloc=self.seal_pool, max_queued=4 * MAX_PARTS,
                           clock=self.clock)
        except (OSError, ValueError) as e:  # a name that no longer resolves, ...: CurveZMQ until the retry
            log.warning("no sealed data connection to %s: %s", self.cfg.server, e)
            self._retry_seal()
            return
        self.seal_sock = s
        s.conn.progress, s.conn.progress_min = self.opener.early, EARLY_MIN  # large frames opened as they arrive
        s.send(self.sealer.seal(encode(Heartbeat(boot=self.boot, credit=self.cfg.credit,
                                                  busy=self._busy(), seen=self.seen))))

    def _retry_seal(self) -> None:
        """Connect again later (doubling the wait, as libzmq's reconnection): meanwhile CurveZMQ."""
        self.seal_retry_at = self.clock() + self.seal_retry_s
        self.seal_retry_s = min(2 * self.seal_retry_s, RECONNECT_IVL_MAX_S)

    def _seal_timers(self) -> bool:
        """The data connection's step of the loop's timers: True if it dropped once up (the caller
        says hello again, see :meth:`_seal_lost`); a connection that never came up is tried again
        later, the session kept."""
        if self.seal_sock is not None:
            return self._seal_lost()
        if self.seal_retry_at is not None and self.clock() >= self.seal_retry_at:
            self._connect_seal()
        return False

    def _close_seal(self, linger: int = 0) -> None:
        """Close the data connection, writing what it holds for up to ``linger`` ms first (a bye)."""
        if self.seal_sock is not None:
            self.seal_sock.close(linger)
        self.seal_sock = self.sealer = self.opener = self.seal_retry_at = None
        self.seal_up = False

    def _seal_lost(self) -> bool:
        """Whether the data connection dropped (checked on every pass of the loop): refused, reset,
        closed, no handshake in time. What was in flight on it is lost, and a job the server sent
        there and this worker never received would stay outstanding at the server for good (its
        heartbeats reconcile only jobs up to ``seen``, PROTOCOL.md 8.6): so the worker says hello
        again, which settles every job it does not hold (8.10) and brings a new session."""
        s = self.seal_sock
        s.check()
        if s.lost is None:
            return False
        if s.conn.peer is None:  # it never came up: nothing was sent on it, so nothing is lost
            log.info("the sealed data connection did not come up (%s): trying again in %.1f s",
                     s.lost, self.seal_retry_s)
            s.close()
            self.seal_sock = None
            self._retry_seal()
            return False
        log.warning("the sealed data connection dropped (%s): saying hello again", s.lost)
        self._close_seal()
        return True

    def _on_sealed(self, frames: list) -> None:
        try:
            opened = self.opener.open(frames)
        except RemoteProtocolError as e:
            self.seal_refused += 1
            now = self.clock()
            if now - self.seal_log_at >= 10.0:
                self.seal_log_at = now
                log.warning("refused a sealed message (%d in all): %s", self.seal_refused, e)
            return
        self.seal_up = True
        self._on_message(opened)

    def _receive_sealed(self, timeout_ms: int) -> None:
        """:meth:`_receive_one` once the server sends on the sealed data connection: what CURVE
        holds (a message the server sent there while the data connection was down) first, without
        waiting, then a wait on the data connection."""
        if self.sock.get(_EVENTS) & _POLLIN:
            try:
                self._on_message(recv_frames(self.sock, _NOBLOCK))
            except zmq.Again:
                pass
            return
        frames = self.seal_sock.recv(timeout_ms, self.spin)
        if frames is not None:
            self._on_sealed(frames)

    def _drain_sealed(self) -> None:
        """Handle up to 64 whole messages the data connection holds (a poll saw it ready), until
        the session changes; write what it holds."""
        s = self.seal_sock
        if s.wants_write:
            s.flush()
        for _ in range(64):
            if not s.pending():
                break
            self._on_sealed(s.inbox.popleft())
            if s is not self.seal_sock:
                break
