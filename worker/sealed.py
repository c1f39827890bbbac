"""The worker's sealed data connection (PROTOCOL.md §6.15; a mixin of :class:`worker.link.Worker`).

Under CurveZMQ a welcome may carry a session (protocol/seal.py): keys for each direction and a
token. The worker then opens a second connection to the same endpoint under ZMTP's NULL
mechanism, its routing id the token (the server's front lets it through only with a token of
that server), and seals a heartbeat on it at once. The server answers on it from that message
on; once something opened there, everything but a hello goes there too, each message's frames
sealed with AES-256-GCM. A message the data connection cannot take now goes over CurveZMQ,
which the worker keeps reading: the server sends there while the data connection is down.
"""

from __future__ import annotations

import logging

import zmq

from protocol.chunks import chunking
from protocol.codec import encode
from protocol.errors import RemoteProtocolError
from protocol.messages import MAX_PARTS, Heartbeat
from protocol.seal import BufferPool, Opener, Sealer, Session, sealer_opener
from worker.sockio import dealer_options, recv_frames, recv_within, send_frames

_EVENTS, _POLLIN, _RCVTIMEO, _NOBLOCK = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.RCVTIMEO), int(zmq.NOBLOCK)
log = logging.getLogger("latecomer.worker")


class SealedLink:
    """The sealed data connection's socket, its session and its loop steps."""

    def _init_seal(self) -> None:
        self.plain_chunking = chunking(False)  # how large replies are split on the data connection
        # the session's socket, its two halves, and whether the server has sent on it (then
        # everything but a hello goes there too)
        self.seal_sock: zmq.Socket | None = None
        self.seal_mon: zmq.Socket | None = None  # its monitor (disconnections)
        self.sealer: Sealer | None = None
        self.opener: Opener | None = None
        self.seal_up = False
        self.seal_rcvtimeo = -1
        self.seal_pool = BufferPool()  # warm buffers for sealing and opening
        self.seal_refused = 0  # sealed messages that did not open (logged once per 10 s)
        self.seal_log_at = -1e9

    def _out(self, frames: list, sealed: bool) -> None:
        """One message out: sealed on the data connection, or over CurveZMQ (also when the data
        connection's queue is full: the server reads both)."""
        if sealed:
            try:
                send_frames(self.seal_sock, self.sealer.seal(frames), _NOBLOCK)
                return
            except zmq.Again:
                pass
        send_frames(self.sock, frames, _NOBLOCK)

    def _open_seal(self, hexed: str) -> None:
        """A welcome's session (PROTOCOL.md §6.15): a NULL-mechanism DEALER to the same endpoint,
        its routing id the session's token, and a heartbeat sealed on it at once: the server
        answers on it from that message on, and this worker sends there once something came."""
        self._close_seal()
        if not hexed or self.curve is None:
            return
        session = Session.unpack(bytes.fromhex(hexed))
        s = self.ctx.socket(zmq.DEALER)
        s.linger = 1000
        s.routing_id = session.token
        s.sndhwm = s.rcvhwm = 4 * MAX_PARTS
        dealer_options(s, self.cfg.server)
        self.seal_mon = s.get_monitor_socket(zmq.EVENT_DISCONNECTED)  # before connect: no event missed
        s.connect(self.cfg.server)
        self.seal_sock, self.seal_rcvtimeo = s, -1
        self.sealer, self.opener = sealer_opener(session, server=False, alloc=self.seal_pool)
        try:
            send_frames(s, self.sealer.seal(encode(Heartbeat(boot=self.boot, credit=self.cfg.credit,
                                                             busy=self._busy(), seen=self.seen))), _NOBLOCK)
        except zmq.Again:
            pass

    def _close_seal(self, linger: int = 0) -> None:
        if self.seal_sock is not None:
            self.seal_sock.disable_monitor()
            self.seal_mon.close(linger=0)
            self.seal_sock.close(linger=linger)
        self.seal_sock = self.sealer = self.opener = self.seal_mon = None
        self.seal_up = False

    def _seal_lost(self) -> bool:
        """Whether the data connection dropped (its monitor says so; checked on every pass of the
        loop). What was in flight on it is lost, and a job the server sent there and this worker
        never received would stay outstanding at the server for good (its heartbeats reconcile
        only jobs up to ``seen``, PROTOCOL.md 8.6): so the worker says hello again, which settles
        every job it does not hold (8.10) and brings a new session."""
        mon = self.seal_mon
        if mon is None or not mon.get(_EVENTS) & _POLLIN:
            return False
        while mon.get(_EVENTS) & _POLLIN:
            mon.recv_multipart()
        log.warning("the sealed data connection dropped: saying hello again")
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
        frames, self.seal_rcvtimeo = recv_within(self.seal_sock, timeout_ms, self.seal_rcvtimeo)
        if frames is not None:
            self._on_sealed(frames)

