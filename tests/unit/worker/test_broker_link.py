"""The worker's IO thread (worker/server.py BrokerLink) against a ROUTER standing in for the broker."""
from __future__ import annotations

import zmq

from common import framing
from common.protocol import ErrorMsg, KvEvents, MsgType, OutputsHeader, WorkerLoad
from worker.server import _CTL, _STOP, BrokerLink


def test_messages_of_a_forgotten_registration_never_precede_the_new_ready():
    """After a reset (broker silent, or it said DISCONNECT) the engine loop may still ship
    what its last step produced before it handles the reset and sends READY.  Those must
    not reach the broker ahead of READY: from an unknown peer they make it answer
    DISCONNECT, which costs a second registration and logs a refused-token warning."""
    ctx = zmq.Context()
    try:
        broker = ctx.socket(zmq.ROUTER)
        broker.bind("inproc://broker")
        pipe = ctx.socket(zmq.PAIR)
        pipe.bind("inproc://pipe")
        link = BrokerLink(ctx, "inproc://broker", "inproc://pipe", interval=60.0, liveness=1000)
        link.start()
        try:
            pipe.send_multipart(framing.message(MsgType.OUTPUTS, OutputsHeader()))  # the old step's
            pipe.send_multipart(framing.message(MsgType.ERROR, ErrorMsg("old", 500, "x")))
            pipe.send_multipart(framing.message(MsgType.KV_EVENTS, KvEvents()))
            pipe.send_multipart(framing.message(MsgType.READY, WorkerLoad()))  # body unread by the link
            pipe.send_multipart(framing.message(MsgType.OUTPUTS, OutputsHeader()))  # the new registration's
            got = []
            while len(got) < 2:
                assert broker.poll(10_000), got
                frames = broker.recv_multipart()
                if frames[2] != MsgType.HEARTBEAT:
                    got.append(frames[2])
            assert got == [MsgType.READY, MsgType.OUTPUTS]
        finally:
            pipe.send_multipart([_CTL, _STOP])
            link.join(10)
    finally:
        ctx.destroy(0)
