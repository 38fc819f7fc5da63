"""``Monitor``'s server (docs/monitoring.md, "Security"): loopback by default, a token beyond it (401
without; ``?token=`` or ``Authorization: Bearer``), read-only, closed for good by ``close()``, and
clear errors for bad arguments or a missing prometheus-client."""

from __future__ import annotations

import http.client
import socket
import sys
import urllib.error
import urllib.parse
import urllib.request

import pytest
from mocks import counting_env_7, weight_policy

from rlharvest.collectors import Collector, Evaluator
from rlharvest.monitor import Monitor

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def collector():
    collector = Collector(counting_env_7, weight_policy(1.0), frames_per_batch=8, total_frames=16)
    yield collector
    collector.shutdown()


def status(url: str, headers: dict | None = None, method: str = "GET") -> int:
    request = urllib.request.Request(url, headers=headers or {}, method=method)
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status
    except urllib.error.HTTPError as err:
        return err.code


def test_bound_beyond_loopback_every_request_needs_the_token(collector):
    with Monitor(collector, host="0.0.0.0") as monitor:
        token = urllib.parse.parse_qs(urllib.parse.urlsplit(monitor.url).query)["token"][0]
        assert len(token) >= 24 and monitor.token == token
        base = f"http://127.0.0.1:{monitor.port}/"
        for path in ("", "metrics", "api/stats", "static/monitor.js"):
            assert status(base + path) == 401, path
            assert status(f"{base}{path}?token=wrong-token") == 401, path
            assert status(f"{base}{path}?token={token}") == 200, path
        assert status(base + "metrics", {"Authorization": f"Bearer {token}"}) == 200  # a Prometheus scrape
        assert status(base + "metrics", {"Authorization": "Bearer not-the-token"}) == 401
        page = urllib.request.urlopen(f"{base}?token={token}", timeout=10).read().decode()
        assert f"static/monitor.js?token={token}" in page  # the page's own files carry it


def test_a_token_given_on_loopback_is_required_too(collector):
    with Monitor(collector, token="s3cret-token") as monitor:
        assert monitor.url.endswith("/?token=s3cret-token")
        assert status(monitor.url.split("?")[0] + "api/stats") == 401
        assert status(monitor.url.split("?")[0] + "api/stats?token=s3cret-token") == 200


def test_the_monitor_is_read_only_and_a_loopback_one_answers_loopback_hosts_only(collector):
    with Monitor(collector) as monitor:
        assert monitor.url == f"http://127.0.0.1:{monitor.port}/" and monitor.token is None
        for method in ("POST", "PUT", "DELETE"):
            assert status(monitor.url + "api/stats", method=method) == 405
        assert status(monitor.url + "nothing-here") == 404
        # a page of another site whose name resolves to 127.0.0.1 (DNS rebinding) reads nothing
        connection = http.client.HTTPConnection("127.0.0.1", monitor.port, timeout=10)
        connection.request("GET", "/api/stats", headers={"Host": f"attacker.example:{monitor.port}"})
        assert connection.getresponse().status == 403
        connection.close()
        assert status(f"http://localhost:{monitor.port}/api/stats") == 200


def test_close_closes_the_port_and_the_connections_kept_alive_for_good(collector):
    monitor = Monitor(collector)
    port = monitor.port
    assert status(monitor.url + "metrics") == 200
    kept = http.client.HTTPConnection("127.0.0.1", port, timeout=10)  # as a browser keeps its connection
    kept.request("GET", "/api/stats")
    assert kept.getresponse().read() and kept.sock is not None
    monitor.close()
    with pytest.raises((ConnectionError, http.client.RemoteDisconnected, OSError)):
        kept.request("GET", "/api/stats")
        kept.getresponse()
    kept.close()
    monitor.close()  # idempotent
    assert monitor.closed
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
    with Monitor(collector) as monitor:
        port = monitor.port
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=5).close()


def test_bad_arguments_are_refused_by_name(collector):
    with pytest.raises(ValueError, match="port must be an int in 0..65535"):
        Monitor(collector, port=70000)
    with pytest.raises(ValueError, match="host must be an address"):
        Monitor(collector, host="")
    for token in ("", "two words", b"bytes"):
        with pytest.raises(ValueError, match="token must be None"):
            Monitor(collector, token=token)
    with pytest.raises(TypeError, match="the monitor watches an rlharvest collector.*got dict"):
        Monitor({})
    evaluator = Evaluator(counting_env_7(), weight_policy(1.0), num_trajectories=1, max_steps=8)
    with pytest.raises(TypeError, match="an Evaluator has no fleet to watch.*on_result="):
        Monitor(evaluator)
    evaluator.shutdown()


def test_without_prometheus_client_the_error_names_the_extra(collector, monkeypatch):
    monkeypatch.setitem(sys.modules, "prometheus_client", None)
    monkeypatch.delitem(sys.modules, "rlharvest.monitor.metrics", raising=False)
    with pytest.raises(ImportError, match=r"pip install 'rlharvest\[monitor\]'"):
        Monitor(collector)
