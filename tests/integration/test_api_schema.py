"""Property-based requests against the bootstrap's own OpenAPI spec: no 5xx, ever."""

import threading

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error

from launcher.local_stack import LocalStack, free_port
from tests.unit.bootstrap.test_api import registration


@pytest.fixture(scope="module")
def bootstrap(tmp_path_factory):
    stack = LocalStack(
        tmp_path_factory.mktemp("schema") / "logs",
        bootstrap_args=["--max-wait-s", "0.2", "--max-prompt-tokens", "512"],
    )
    stack.bootstrap.start()
    stack.bootstrap.wait_healthy(registered=False)
    url = stack.bootstrap.url
    # Nodes that stay alive, so POST /rooms always has somewhere to go (their ZMQ ports are idle).
    nodes = [registration("p0", "prefill", port=free_port()), registration("d0", "decode", port=free_port())]
    stop = threading.Event()

    auth = stack.auth()

    def keep_alive():
        while not stop.is_set():
            for node in nodes:
                if (
                    httpx.put(f"{url}/nodes/{node['node_id']}/heartbeat", json={}, headers=auth).status_code
                    == 404
                ):
                    httpx.post(f"{url}/nodes", json=node, headers=auth)
            stop.wait(0.5)

    for node in nodes:
        assert httpx.post(f"{url}/nodes", json=node, headers=auth).status_code == 201
    beat = threading.Thread(target=keep_alive, daemon=True)
    beat.start()
    try:
        yield url, auth
    finally:
        stop.set()
        beat.join(5)
        stack.stop()


def test_no_server_errors(bootstrap):
    url, auth = bootstrap
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 11

    def check(operation, headers):
        @given(case=operation.as_strategy())
        @settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        def no_5xx(case):
            case.call_and_validate(headers=headers, checks=[not_a_server_error])

        no_5xx()

    for operation in operations:
        for headers in ({}, auth):  # refused at the door, and let in
            check(operation, headers)
