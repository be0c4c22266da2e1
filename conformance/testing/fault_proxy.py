"""A deliberately broken kvhint.v1 servicer: a gRPC proxy that sits in front of a real engine's
KvHint endpoint and injects one or more faults. It exists to prove the conformance suite catches
breakage (tests/conformance), and lets an implementer check the suite the same way:

    python -m conformance.testing.fault_proxy --upstream 127.0.0.1:50151 --fault ignore-pins
    kvhint-conformance --target <printed address> --openai-url ...   # must fail

Every method is forwarded as raw bytes (kvhint.v1, grpc.health.v1, server reflection); only the
messages a fault concerns are decoded and rewritten. Faults: see FAULTS.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from collections.abc import Iterable, Iterator
from concurrent import futures
from typing import Any

import grpc

from kvhint.v1 import kvhint_pb2 as pb

SERVICE = "/kvhint.v1.KvHintService/"
APPLY = SERVICE + "ApplyHints"
WATCH = SERVICE + "WatchEvents"
QUERY = SERVICE + "QueryResidency"
STATUS_DETAILS = "grpc-status-details-bin"
UNARY_STREAM = {WATCH, "/grpc.health.v1.Health/Watch"}
STREAM_STREAM = {
    "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
    "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
}

FAULTS: dict[str, str] = {
    "no-epoch": "WatchEvents messages carry no epoch",
    "ignore-pins": "PIN hints are dropped but reported ACCEPTED (with the selection's block count)",
    "missing-as-accepted": "MISSING results are reported as ACCEPTED",
    "unsupported-as-accepted": "REJECTED/UNSUPPORTED results are reported as ACCEPTED",
    "no-ttl-clip": "TTL_CAPPED clips are hidden: ACCEPTED with the requested TTL",
    "no-error-info": "failed RPCs lose their google.rpc.Status details (no ErrorInfo)",
    "repeat-sequence": "every second WatchEvents event repeats the previous event's sequence",
    "no-resync": "Resync messages are swallowed (the stream just ends)",
    "strip-removed-coordinates": "BlocksRemoved events lose their session coordinates",
    "no-replay-flag": "replayed results are not marked replayed",
    "ignore-evicts": "EVICT hints are dropped but reported ACCEPTED",
    "ignore-retains": "RETAIN hints are dropped but reported ACCEPTED (with the selection's block count)",
    "ignore-releases": "RELEASE hints are dropped but reported ACCEPTED (with the selection's block count)",
    "strip-stored-coordinates": "BlocksStored events lose their session coordinates",
    "drop-events": "every third event on a WatchEvents stream is dropped (control messages pass)",
}
# Faults that drop one action's hints and answer ACCEPTED in the engine's place.
DROPPED_ACTIONS = {"ignore-pins": "pin", "ignore-evicts": "evict", "ignore-retains": "retain", "ignore-releases": "release"}
# Faults that rewrite WatchEvents messages.
EVENT_FAULTS = frozenset({"no-epoch", "repeat-sequence", "no-resync", "strip-removed-coordinates",
                          "strip-stored-coordinates", "drop-events"})
CONTROL = frozenset({"heartbeat", "snapshot_begin", "snapshot_chunk", "snapshot_end", "resync"})


class FaultProxy:
    def __init__(self, upstream: str, faults: Iterable[str] = (), listen: str = "127.0.0.1:0") -> None:
        self.faults = frozenset(faults)
        unknown = self.faults - set(FAULTS)
        if unknown:
            raise ValueError(f"unknown faults: {', '.join(sorted(unknown))}; known: {', '.join(FAULTS)}")
        self.upstream_address = upstream
        self.upstream = grpc.insecure_channel(upstream)
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=64, thread_name_prefix="fault-proxy"))
        self.server.add_generic_rpc_handlers([_Handler(self)])
        host = listen.rsplit(":", 1)[0]
        self.port = self.server.add_insecure_port(listen)
        self.address = f"{host}:{self.port}"
        self._sequence_lock = threading.Lock()
        self._max_ttl: float | None = None

    def start(self) -> FaultProxy:
        self.server.start()
        return self

    def stop(self) -> None:
        self.server.stop(grace=1).wait(5)
        self.upstream.close()

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- upstream helpers ------------------------------------------------------------------

    def _unary(self, method: str, request: bytes, timeout: float | None) -> bytes:
        return self.upstream.unary_unary(method)(request, timeout=timeout)  # type: ignore[no-any-return]

    def _device_blocks(self, selector: pb.Selector, timeout: float | None) -> int:
        try:
            raw = self._unary(QUERY, pb.QueryResidencyRequest(selector=selector, tiers=[pb.TIER_DEVICE]).SerializeToString(), timeout)
        except grpc.RpcError:
            return 0
        response = pb.QueryResidencyResponse.FromString(raw)
        return sum(t.blocks for t in response.totals if t.tier == pb.TIER_DEVICE)

    # -- requests --------------------------------------------------------------------------

    def rewrite_request(self, method: str, raw: bytes) -> bytes:
        """The request bytes forwarded for `method` (unary and server-streaming calls). No fault
        rewrites requests; a subclass that breaks request validation does (tests/conformance)."""
        return raw

    # -- ApplyHints ------------------------------------------------------------------------

    def apply_hints(self, raw: bytes, timeout: float | None) -> bytes:
        dropped_actions = {a for f, a in DROPPED_ACTIONS.items() if f in self.faults}
        try:
            request = pb.ApplyHintsRequest.FromString(raw)
        except Exception:  # noqa: BLE001 - undecodable: the engine answers
            return self._unary(APPLY, raw, timeout)
        dropped = [i for i, h in enumerate(request.hints) if h.WhichOneof("action") in dropped_actions and h.HasField("selector")]
        if not dropped or len(request.hints) > 10_000:
            response = pb.ApplyHintsResponse.FromString(self._unary(APPLY, raw, timeout))
        else:
            kept = [h for i, h in enumerate(request.hints) if i not in dropped]
            probe = not kept
            if probe:  # still ask the engine, for the epoch and sequence
                kept = [pb.Hint(selector=pb.Selector(session=pb.SessionSelector(session_id="fault-proxy-probe")), release=pb.ReleaseAction())]
            forwarded = pb.ApplyHintsResponse.FromString(self._unary(APPLY, pb.ApplyHintsRequest(hints=kept).SerializeToString(), timeout))
            results = list(forwarded.results) if not probe else []
            merged: list[pb.HintResult] = []
            for i, hint in enumerate(request.hints):
                if i in dropped:
                    merged.append(self._fake_accept(hint, timeout))
                else:
                    merged.append(results.pop(0))
            response = pb.ApplyHintsResponse(results=merged, epoch=forwarded.epoch, applied_at_sequence=forwarded.applied_at_sequence)
        for result, hint in zip(response.results, request.hints):
            self._rewrite_result(result, hint)
        return response.SerializeToString()

    def _fake_accept(self, hint: pb.Hint, timeout: float | None) -> pb.HintResult:
        result = pb.HintResult(hint_id=hint.hint_id, outcome=pb.OUTCOME_ACCEPTED)
        blocks = self._device_blocks(hint.selector, timeout)
        if hint.max_blocks:
            blocks = min(blocks, hint.max_blocks)
        if blocks:
            result.affected_blocks.add(tier=pb.TIER_DEVICE, blocks=blocks)
        if hint.HasField("pin"):
            result.effective_ttl.CopyFrom(hint.pin.ttl)
        elif hint.HasField("retain"):
            result.effective_ttl.CopyFrom(hint.retain.ttl)
        return result

    def _rewrite_result(self, result: pb.HintResult, hint: pb.Hint) -> None:
        f = self.faults
        if "missing-as-accepted" in f and result.outcome == pb.OUTCOME_MISSING:
            result.outcome = pb.OUTCOME_ACCEPTED
            result.reason = pb.REASON_UNSPECIFIED
            result.message = ""
        if "unsupported-as-accepted" in f and result.outcome == pb.OUTCOME_REJECTED and result.reason == pb.REASON_UNSUPPORTED:
            result.outcome = pb.OUTCOME_ACCEPTED
            result.reason = pb.REASON_UNSPECIFIED
            result.message = ""
        if "no-ttl-clip" in f and result.outcome == pb.OUTCOME_CLIPPED:
            clips = [c for c in result.clips if c.reason != pb.REASON_TTL_CAPPED]
            if len(clips) != len(result.clips):
                del result.clips[:]
                result.clips.extend(clips)
                ttl = hint.pin.ttl if hint.HasField("pin") else hint.retain.ttl
                result.effective_ttl.CopyFrom(ttl)
                if clips:
                    result.reason = clips[0].reason
                else:
                    result.outcome = pb.OUTCOME_ACCEPTED
                    result.reason = pb.REASON_UNSPECIFIED
                    result.message = ""
        if "no-replay-flag" in f:
            result.replayed = False

    # -- WatchEvents -----------------------------------------------------------------------

    def rewrite_event(self, raw: bytes, state: dict[str, Any]) -> bytes | None:
        f = self.faults
        if not f & EVENT_FAULTS:
            return raw
        message = pb.WatchEventsResponse.FromString(raw)
        payload = message.WhichOneof("payload")
        if "no-resync" in f and payload == "resync":
            return None
        if "drop-events" in f and payload not in CONTROL:
            state["events"] = state.get("events", 0) + 1
            if state["events"] % 3 == 0:
                return None
        if "no-epoch" in f:
            message.epoch = ""
        if "strip-removed-coordinates" in f and payload == "blocks_removed":
            message.blocks_removed.ClearField("coordinates")
        if "strip-stored-coordinates" in f and payload == "blocks_stored":
            message.blocks_stored.ClearField("coordinates")
        if "repeat-sequence" in f and payload not in CONTROL:
            state["n"] = state.get("n", 0) + 1
            if state["n"] % 2 == 0 and "last" in state:
                message.sequence = state["last"]
            state["last"] = message.sequence
        return message.SerializeToString()

    def trailing(self, err: grpc.RpcError) -> list[tuple[str, Any]]:
        md = list(err.trailing_metadata() or ())  # type: ignore[attr-defined]
        if "no-error-info" in self.faults:
            md = [(k, v) for k, v in md if k != STATUS_DETAILS]
        return md


def _remaining(context: grpc.ServicerContext) -> float | None:
    left = context.time_remaining()
    return None if left is None or left > 1e6 else max(0.001, left)


class _Handler(grpc.GenericRpcHandler):
    def __init__(self, proxy: FaultProxy) -> None:
        self.proxy = proxy

    def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        method = details.method
        if method in UNARY_STREAM:
            return grpc.unary_stream_rpc_method_handler(lambda req, ctx: self._stream(method, req, ctx))
        if method in STREAM_STREAM:
            return grpc.stream_stream_rpc_method_handler(lambda it, ctx: self._bidi(method, it, ctx))
        return grpc.unary_unary_rpc_method_handler(lambda req, ctx: self._unary(method, req, ctx))

    def _fail(self, err: grpc.RpcError, context: grpc.ServicerContext) -> None:
        context.set_trailing_metadata(tuple(self.proxy.trailing(err)))
        context.abort(err.code(), err.details() or "")  # type: ignore[attr-defined]

    def _unary(self, method: str, request: bytes, context: grpc.ServicerContext) -> bytes:
        timeout = _remaining(context)
        request = self.proxy.rewrite_request(method, request)
        try:
            if method == APPLY:
                return self.proxy.apply_hints(request, timeout)
            return self.proxy._unary(method, request, timeout)
        except grpc.RpcError as err:
            self._fail(err, context)
            raise  # unreachable: abort raised

    def _stream(self, method: str, request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
        request = self.proxy.rewrite_request(method, request)
        call = self.proxy.upstream.unary_stream(method)(request, timeout=_remaining(context))
        context.add_callback(call.cancel)
        state: dict[str, Any] = {}
        try:
            for raw in call:
                out = self.proxy.rewrite_event(raw, state) if method == WATCH else raw
                if out is not None:
                    yield out
        except grpc.RpcError as err:
            if err.code() == grpc.StatusCode.CANCELLED and not context.is_active():
                return
            self._fail(err, context)

    def _bidi(self, method: str, requests: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[bytes]:
        call = self.proxy.upstream.stream_stream(method)(requests, timeout=_remaining(context))
        context.add_callback(call.cancel)
        try:
            yield from call
        except grpc.RpcError as err:
            if err.code() == grpc.StatusCode.CANCELLED and not context.is_active():
                return
            self._fail(err, context)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m conformance.testing.fault_proxy", description=__doc__.split("\n\n")[0])
    p.add_argument("--upstream", required=True, metavar="HOST:PORT", help="the real kvhint.v1 endpoint")
    p.add_argument("--listen", default="127.0.0.1:0", metavar="HOST:PORT")
    p.add_argument("--fault", action="append", default=[], choices=sorted(FAULTS), help="repeatable")
    p.add_argument("--list-faults", action="store_true")
    args = p.parse_args(argv)
    if args.list_faults:
        for name, text in FAULTS.items():
            print(f"{name:28} {text}")
        return 0
    proxy = FaultProxy(args.upstream, args.fault, args.listen).start()
    print(proxy.address, flush=True)
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    signal.signal(signal.SIGINT, lambda *_: done.set())
    done.wait()
    proxy.stop()
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
