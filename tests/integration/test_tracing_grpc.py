"""Traces over OTLP/gRPC: ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=grpc`` (OpenTelemetry's own
variable, as vLLM reads it) with the gRPC exporter installed sends the same spans to a
real gRPC ``TraceService`` built on ``opentelemetry-proto``; a wire Tandem does not speak
is refused before anything starts."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from tests.integration.test_tracing import (
    CLIENT_SPAN,
    FAST_EXPORT,
    TRACE_ID,
    Span,
    _spans,
    chat_stream,
)
from tests.stack import TandemStack, free_port


class GrpcReceiver(trace_service_pb2_grpc.TraceServiceServicer):
    """OTLP's gRPC trace service on loopback, keeping every span it is sent."""

    def __init__(self) -> None:
        self.spans: list[Span] = []
        self._lock = threading.Lock()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self._server)
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        self._server.start()

    def Export(  # the service's method name
        self, request: ExportTraceServiceRequest, context: Any
    ) -> ExportTraceServiceResponse:
        with self._lock:
            self.spans += list(_spans(request))
        return ExportTraceServiceResponse()

    def close(self) -> None:
        self._server.stop(grace=None)


def test_spans_go_over_grpc_when_opentelemetrys_variable_says_so(smollm2_dir: Path) -> None:
    receiver = GrpcReceiver()
    env = {**FAST_EXPORT, "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc"}
    try:
        with TandemStack(
            "--max-num-seqs",
            "4",
            "--otlp-traces-endpoint",
            f"http://127.0.0.1:{receiver.port}",
            env=env,
        ) as stack:
            usage = chat_stream(stack.url, "Say hi.", f"00-{TRACE_ID}-{CLIENT_SPAN}-01")
            deadline = time.monotonic() + 15
            wanted = {"POST /v1/chat/completions", "llm_request", "decode_steps"}
            while not wanted <= {s.name for s in receiver.spans if s.trace_id == TRACE_ID}:
                assert time.monotonic() < deadline, [s.name for s in receiver.spans]
                time.sleep(0.1)
            assert "(grpc)" in stack.log()  # each process says which wire it exports on
    finally:
        receiver.close()
    spans = {s.name: s for s in receiver.spans if s.trace_id == TRACE_ID}
    http, root = spans["POST /v1/chat/completions"], spans["llm_request"]
    assert http.parent_id == CLIENT_SPAN and root.parent_id == http.span_id
    assert root.attributes["gen_ai.usage.output_tokens"] == usage["completion_tokens"]


def test_a_wire_tandem_does_not_speak_is_refused_before_anything_starts(
    smollm2_dir: Path,
) -> None:
    port = free_port()
    command = [sys.executable, "-m", "common.cli", "serve", "--port", str(port)]
    command += ["--otlp-traces-endpoint", "http://127.0.0.1:4318/v1/traces"]
    env = {"OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"}
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=60, env={**os.environ, **env}
    )
    assert done.returncode == 2, done.stderr
    assert "OTEL_EXPORTER_OTLP_PROTOCOL=http/json: traces go over 'http/protobuf'" in done.stderr
