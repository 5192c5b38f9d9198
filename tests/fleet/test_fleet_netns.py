"""Real network faults between a gateway and its workers. Each `sluice worker` runs in its own network
namespace, reached over a veth pair with addresses made here; both directions of every link are
degraded (tc netem delay + loss where the kernel has netem, else a tbf rate limit: a slow link), then
the link of the busiest worker is cut mid-stream (`ip link set down` on the worker's side: packets
vanish, no reset). Every stream must complete with exactly the uninterrupted text (the ones on the cut
link fail over), and the cut worker must leave the view. Nothing is timed; deadlines catch hangs.

Needs root (ip netns); skipped otherwise. Namespaces and links are removed however the test ends.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from fleet_processes import WorkerProcess, gateway, nodes
from test_fleet_failover import SLOW, check_all_complete, prompts, reference, run_streams

from tests.polling import wait_until

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None,
                                reason="network namespaces need root and iproute2")

_TAG = f"sl{os.getpid() % 100000}"  # names unique to this run (interface names are at most 15 chars)


@dataclass(frozen=True)
class Namespace:
    name: str
    host_if: str  # the veth end on the gateway's (host) side
    ns_if: str  # the end inside the namespace, where the worker listens
    ns_ip: str


def _run(*cmd: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(cmd, check=True, capture_output=True, timeout=10)


@contextlib.contextmanager
def namespaces(count: int) -> Iterator[list[Namespace]]:
    made: list[Namespace] = []
    subnet = 10 + os.getpid() % 240  # 10.231.<subnet>.0/24, one /30 per namespace
    try:
        for i in range(count):
            n = Namespace(f"{_TAG}n{i}", f"{_TAG}h{i}", f"{_TAG}w{i}", f"10.231.{subnet}.{4 * i + 2}")
            _run("ip", "netns", "add", n.name)
            made.append(n)
            _run("ip", "link", "add", n.host_if, "type", "veth", "peer", "name", n.ns_if, "netns", n.name)
            _run("ip", "addr", "add", f"10.231.{subnet}.{4 * i + 1}/30", "dev", n.host_if)
            _run("ip", "link", "set", n.host_if, "up")
            _run("ip", "-n", n.name, "addr", "add", f"{n.ns_ip}/30", "dev", n.ns_if)
            _run("ip", "-n", n.name, "link", "set", n.ns_if, "up")
            _run("ip", "-n", n.name, "link", "set", "lo", "up")
        yield made
    finally:
        for n in made:  # deleting the namespace deletes its veth end, and with it the pair
            subprocess.run(["ip", "netns", "del", n.name], check=False, capture_output=True, timeout=10)
            subprocess.run(["ip", "link", "del", n.host_if], check=False, capture_output=True, timeout=10)


def degrade(n: Namespace) -> str:
    """Delay and loss on both ends of the link (netem), or where the kernel lacks netem, a rate limit
    (tbf); returns which."""
    netem = ["netem", "delay", "20ms", "5ms", "loss", "1%"]
    tbf = ["tbf", "rate", "4mbit", "burst", "16kb", "latency", "50ms"]
    for qdisc in (netem, tbf):
        try:
            _run("tc", "qdisc", "add", "dev", n.host_if, "root", *qdisc)
            _run("ip", "netns", "exec", n.name, "tc", "qdisc", "add", "dev", n.ns_if, "root", *qdisc)
            return qdisc[0]
        except subprocess.CalledProcessError:
            subprocess.run(["tc", "qdisc", "del", "dev", n.host_if, "root"], check=False, capture_output=True,
                           timeout=10)
    raise AssertionError("neither netem nor tbf could be set on the link")


@contextlib.contextmanager
def namespaced_workers(spaces: list[Namespace]) -> Iterator[list[WorkerProcess]]:
    started: list[WorkerProcess] = []
    try:
        for i, n in enumerate(spaces):
            started.append(WorkerProcess(f"w{i}", SLOW, wait=False, host=n.ns_ip,
                                         wrapper=["ip", "netns", "exec", n.name]))
        for w in started:
            w.wait_ready(60)
        yield started
    finally:
        for w in started:
            w.stop()


def test_degraded_links_then_a_cut_link_mid_stream_every_stream_completes() -> None:
    with namespaces(2) as spaces, namespaced_workers(spaces) as ws, \
            gateway("--workers", ",".join(w.url for w in ws), "--fleet-policy", "least-loaded",
                    "--fleet-max-attempts", "4") as base:
        wait_until(lambda: len(nodes(base)) == 2, "both namespaced workers in the view")
        kinds = {degrade(n) for n in spaces}
        print(f"links degraded with {kinds}")
        texts = prompts(8)
        expected = reference(texts)
        streams = run_streams(base, texts)
        busy = max(nodes(base), key=lambda n: int(str(n["in_flight"])))
        assert int(str(busy["in_flight"])) > 0
        cut = spaces[[w.worker_id for w in ws].index(str(busy["id"]))]
        _run("ip", "-n", cut.name, "link", "set", cut.ns_if, "down")
        check_all_complete(streams, expected)  # the cut ones resumed on the other worker
        wait_until(lambda: busy["id"] not in {n["id"] for n in nodes(base)}, "the cut-off worker out of the view", 30)
