"""Reading spans off a real Kafka topic, and a fixed address for a broker that restarts.

`TopicSpans` is a `confluent-kafka` (librdkafka) consumer assigned to every partition of the
span topic from offset 0 (no consumer group: nothing to rebalance when the broker restarts);
each message is one OTLP protobuf `ExportTraceServiceRequest`, as a Collector's Kafka exporter
writes it, flattened with `gateway.testing.otlp_receiver.flatten_spans`.

`Forwarder` is a TCP port that forwards every connection to the broker's current port. tansu
does not bind with SO_REUSEADDR, so a broker stopped with clients connected cannot listen on
the same port again until the kernel's TIME_WAIT (60 s) is over; the forwarder keeps the
address the clients know while the broker behind it stops and a new one starts, as a Service
address does in front of a restarted pod.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from collections.abc import Callable
from typing import Self

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from deploy.stack import TOPIC
from gateway.testing.otlp_receiver import ReceivedSpan, flatten_spans

__all__ = ("Forwarder", "TopicSpans")

_quiet = logging.getLogger("tests.kafka")
_quiet.addHandler(logging.NullHandler())
_quiet.propagate = False


class TopicSpans:
    """The spans on `topic` at the broker `bootstrap` (host:port), read from the start."""

    def __init__(self, bootstrap: str, topic: str = TOPIC) -> None:
        from confluent_kafka import Consumer, TopicPartition

        self.topic = topic
        self.messages = 0
        self._requests: list[ExportTraceServiceRequest] = []
        self._consumer = Consumer(
            {
                "bootstrap.servers": bootstrap,
                "group.id": "visiongate-tests",  # required; never joined (assign, no subscribe)
                "enable.auto.commit": False,
                "log_level": 0,
                "logger": _quiet,  # a broker that is down is expected here, not worth a log
            }
        )
        metadata = self._consumer.list_topics(topic, timeout=10)
        partitions = sorted(metadata.topics[topic].partitions)
        assert partitions, f"topic {topic} has no partitions"
        self._consumer.assign([TopicPartition(topic, p, 0) for p in partitions])

    def poll(self, budget_s: float = 0.2) -> None:
        deadline = time.monotonic() + budget_s
        while (left := deadline - time.monotonic()) > 0:
            message = self._consumer.poll(min(left, 0.1))
            if message is None or message.error() is not None:
                continue
            request = ExportTraceServiceRequest()
            request.ParseFromString(message.value())
            self._requests.append(request)
            self.messages += 1

    def spans(self) -> list[ReceivedSpan]:
        self.poll()
        return flatten_spans(self._requests)

    def wait_for(
        self, predicate: Callable[[list[ReceivedSpan]], bool], timeout: float = 20.0
    ) -> list[ReceivedSpan]:
        deadline = time.monotonic() + timeout
        while True:
            spans = self.spans()
            if predicate(spans):
                return spans
            if time.monotonic() > deadline:
                names = sorted({s.name for s in spans})
                raise AssertionError(f"no matching spans on {self.topic} in {timeout}s: {names}")

    def close(self) -> None:
        self._consumer.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Forwarder:
    """Listens on a fixed loopback port and pipes each connection to `127.0.0.1:target`;
    `target` may change between connections. A connection the target refuses is closed."""

    def __init__(self, target: int) -> None:
        self.target = target
        self._server = socket.create_server(("127.0.0.1", 0))  # SO_REUSEADDR set on POSIX
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)

    @property
    def port(self) -> int:
        return int(self._server.getsockname()[1])

    def start(self) -> Self:
        self._thread.start()
        return self

    def drop_all(self) -> None:
        """Close every forwarded connection, as the broker going away does."""
        with self._lock:
            conns, self._conns = self._conns, set()
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.close()

    def stop(self) -> None:
        self._stop.set()
        with contextlib.suppress(OSError):
            self._server.close()
        self.drop_all()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target), timeout=2)
                upstream.settimeout(None)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._conns |= {client, upstream}
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while chunk := src.recv(65536):
                dst.sendall(chunk)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
                with contextlib.suppress(OSError):
                    s.close()
            with self._lock:
                self._conns -= {src, dst}
