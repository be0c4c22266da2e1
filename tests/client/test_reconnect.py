"""Fast recovery after an engine restart (issue 14, item 5).

A real KvHintServer (engine-neutral core + FakeEngine) is stopped, stays away
for OUTAGE_S (long enough that gRPC's default connection backoff, 1 s growing
1.6x, would already be several seconds out), and a new one, a new epoch, is
started on the same port. A KvHintClient polling on the channel it used
before, and an EventFollower with default settings, must both be in the new
epoch within BOUND_S of the new server answering SERVING.
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path
from typing import Optional

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from kvhint_unit_support import FakeEngine, local_engine_info  # noqa: E402

from kvhint_client import KvHintClient  # noqa: E402
from kvhint_client.config import ConnectionConfig  # noqa: E402
from kvhint_client.errors import KvHintError  # noqa: E402
from kvhint_client.follower import EventFollower  # noqa: E402
from kvhint_server import KvHintCore, KvHintServer, ServerConfig  # noqa: E402

OUTAGE_S = 6.0
BOUND_S = 2.0


class Engine:
    """One engine lifetime: core + fake engine + sidecar on `address`."""

    def __init__(self, address: str) -> None:
        self.core = KvHintCore(ServerConfig(address=address))
        self.fake = FakeEngine(self.core, local_engine_info())
        self.core.attach(self.fake)
        self.fake.start()
        self.server = KvHintServer(self.core)
        self.port = self.server.start()
        self.serving_at = time.monotonic()  # start() returns once health says SERVING

    @property
    def epoch(self) -> str:
        return self.core.bus.epoch

    def stop(self) -> None:
        self.server.stop(grace=0.1)
        self.fake.stop()


class FirstSeen:
    """Records when a watcher first observed `epoch`."""

    def __init__(self) -> None:
        self.epoch: Optional[str] = None
        self.at: dict[str, float] = {}
        self.cond = threading.Condition()

    def saw(self, who: str, epoch: str) -> None:
        with self.cond:
            if epoch == self.epoch and who not in self.at:
                self.at[who] = time.monotonic()
                self.cond.notify_all()

    def wait(self, who: set[str], timeout: float) -> bool:
        with self.cond:
            return self.cond.wait_for(lambda: who <= set(self.at), timeout)


def _poll_client(client: KvHintClient, seen: FirstSeen, stop: threading.Event) -> None:
    while not stop.is_set():
        try:
            seen.saw("client", client.capabilities(timeout=1.0).epoch)
        except KvHintError:
            pass
        stop.wait(0.05)


@pytest.mark.timeout(60)
def test_client_and_follower_reach_the_new_epoch_within_2s_of_serving():
    first = Engine("127.0.0.1:0")
    address = f"127.0.0.1:{first.port}"
    seen, stop = FirstSeen(), threading.Event()
    client = KvHintClient(ConnectionConfig(address=address))
    follower = EventFollower({"e": address}, heartbeat=0.2)
    poller = threading.Thread(target=_poll_client, args=(client, seen, stop), daemon=True)
    second: Optional[Engine] = None
    try:
        follower.start()
        assert follower.wait_synced(10)
        assert client.capabilities().epoch == first.epoch
        poller.start()
        first.stop()
        time.sleep(OUTAGE_S)
        second = Engine(address)
        seen.epoch = second.epoch
        deadline = second.serving_at + BOUND_S + 3.0
        while time.monotonic() < deadline and "follower" not in seen.at:
            position = follower.position("e")
            if position is not None and position[0] == second.epoch and follower.index.is_live("e"):
                seen.saw("follower", second.epoch)
            time.sleep(0.01)
        seen.wait({"client", "follower"}, max(0.0, deadline - time.monotonic()))
        delays = {who: round(at - second.serving_at, 3) for who, at in seen.at.items()}
        print(f"reached the new epoch after SERVING (s): {delays}")
        assert set(delays) == {"client", "follower"}, delays
        assert all(d <= BOUND_S for d in delays.values()), delays
    finally:
        stop.set()
        follower.stop()
        client.close()
        if second is not None:
            second.stop()
