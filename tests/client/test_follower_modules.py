"""The follower's split: ResidencyIndex and the sans-IO EngineTracker work without grpc, and
kvhint_client.follower still offers every name it offered before the split."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from kvhint_client import follow_tracker, follower, residency_index
from kvhint_client.errors import KvHintError

REPO = Path(__file__).resolve().parents[2]

#: Runs with grpc made unimportable: imports the two transport-free modules, follows a scripted
#: snapshot and one event through them, and answers a router query.
_WITHOUT_GRPC = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in ('grpc', 'grpc_status'):
            raise ImportError('blocked: ' + name)
sys.meta_path.insert(0, Block())
from kvhint.v1 import kvhint_pb2 as pb
from kvhint_client.residency_index import ResidencyIndex
from kvhint_client.follow_tracker import EngineTracker
index = ResidencyIndex()
tracker = EngineTracker('e1', 'addr', index)
assert tracker.subscription() == ('snapshot', None)
block = pb.BlockInfo(block_hash=b'\\x01', tiers=[pb.TIER_DEVICE])
for message in (
    pb.WatchEventsResponse(epoch='E1', sequence=3, snapshot_begin=pb.SnapshotBegin()),
    pb.WatchEventsResponse(epoch='E1', sequence=3, snapshot_chunk=pb.SnapshotChunk(blocks=[block])),
    pb.WatchEventsResponse(epoch='E1', sequence=3, snapshot_chunk=pb.SnapshotChunk(session_id='S1', blocks=[block])),
    pb.WatchEventsResponse(epoch='E1', sequence=3, snapshot_end=pb.SnapshotEnd()),
    pb.WatchEventsResponse(epoch='E1', sequence=4, blocks_stored=pb.BlocksStored(
        tier=pb.TIER_HOST, block_hashes=[b'\\x02'], coordinates=pb.SessionCoordinates(session_id='S1'))),
):
    tracker.handle(message)
ranked = index.engines_for_session('S1')
assert [(r.engine, r.blocks) for r in ranked] == [('e1', 2)], ranked
assert tracker.position == ('E1', 4)
assert 'grpc' not in sys.modules
print('ok')
"""


def test_index_and_tracker_follow_a_stream_without_grpc() -> None:
    proc = subprocess.run([sys.executable, "-c", _WITHOUT_GRPC], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]


def test_follower_still_exports_the_index_and_tracker() -> None:
    for module in (residency_index, follow_tracker):
        for name in module.__all__:
            assert getattr(follower, name) is getattr(module, name), name


#: The codes that made a tracker give up resuming before the split (grpc.StatusCode members).
_REFUSED = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION,
            grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.NOT_FOUND}


@pytest.mark.parametrize("code", list(grpc.StatusCode), ids=lambda c: c.name)
def test_only_a_refused_subscription_forces_a_snapshot(code: grpc.StatusCode) -> None:
    """The tracker compares status codes by name (it imports no grpc); every grpc code still
    gets the pre-split decision: resume after a failure, re-snapshot after a refusal."""
    from kvhint.v1 import kvhint_pb2 as pb

    tracker = follow_tracker.EngineTracker("e1", "addr", residency_index.ResidencyIndex())
    tracker.subscription()
    for message in (
        pb.WatchEventsResponse(epoch="E1", sequence=3, snapshot_begin=pb.SnapshotBegin()),
        pb.WatchEventsResponse(epoch="E1", sequence=3, snapshot_end=pb.SnapshotEnd()),
    ):
        tracker.handle(message)
    tracker.stream_ended(KvHintError(code, "stream failed"))
    expected = ("snapshot", None) if code in _REFUSED else ("resume", ("E1", 3))
    assert tracker.subscription() == expected
