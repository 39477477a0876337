"""The command-line client against canned bootstrap answers (httpx.MockTransport): no services run."""

import json

import httpx
import pytest

from bootstrap.client import main
from launcher.local_stack import free_port
from shared.cli import VERSION

BIG = 2**53 - 1  # 9007199254740991: the largest room id a JSON reader in a browser keeps exact


def room(room_id=BIG, state="SUCCESS", **changes):
    return {
        "room": room_id,
        "state": state,
        "transfer_state": state,
        "outcome": "completed" if state == "SUCCESS" else None,
        "reason": None,
        "finish_reason": "length",
        "finished": state in ("SUCCESS", "FAILED"),
        "prompt_tokens": 5,
        "max_new_tokens": 4,
        "output_ids": [1, 2, 3, 4],
        "text": "line one\nline two and a rather long tail that will not fit",
        "prefill": {"node_id": "prefill-0", "session_ids": ["127.0.0.1:4000"]},
        "decode": {"node_id": "decode-0", "session_ids": ["127.0.0.1:4100"]},
        "node_states": {},
        "timestamps": {},
        "timings": {},
        **changes,
    }


def node(node_id="prefill-0", role="prefill", **changes):
    return {
        "node_id": node_id,
        "role": role,
        "version": "0.2.0",
        "alive": True,
        "healthy": True,
        "draining": False,
        "problem": None,
        "tp_size": 2,
        "ranks": [],
        "model": {},
        "compat_hash": "abc",
        "verify_kv": True,
        "num_pages": 64,
        "free_pages": 60,
        "rooms_in_flight": 1,
        "seconds_since_heartbeat": 0.25,
        **changes,
    }


STATE_422 = {
    "detail": [
        {
            "loc": ["query", "state"],
            "msg": "Input should be 'FAILED', 'BOOTSTRAPPING', 'WAITING_FOR_INPUT', "
            "'TRANSFERRING' or 'SUCCESS'",
            "type": "literal_error",
        }
    ]
}


class Bootstrap:
    """Canned answers by (method, path); records every request it is sent."""

    def __init__(self, answers):
        self.answers = answers
        self.requests: list[httpx.Request] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        status, body = self.answers.get((request.method, request.url.path), (404, {"detail": "Not Found"}))
        if isinstance(body, str):
            return httpx.Response(status, text=body)
        return httpx.Response(status, json=body)


def run(capsys, argv, answers=None):
    bootstrap = Bootstrap(answers or {})
    code = main(["--url", "http://bootstrap.test:8000", *argv], transport=httpx.MockTransport(bootstrap))
    out, err = capsys.readouterr()
    return code, out, err, bootstrap


@pytest.fixture(autouse=True)
def no_env(monkeypatch):
    monkeypatch.delenv("KVROOM_API_KEY", raising=False)
    monkeypatch.delenv("KVROOM_URL", raising=False)


def test_rooms_table(capsys):
    failed = room(7, "FAILED", outcome="failed", reason="peer_lost", output_ids=None, text=None)
    code, out, err, _ = run(capsys, ["rooms"], {("GET", "/rooms"): (200, [room(), failed])})
    assert code == 0 and err == ""
    lines = out.splitlines()
    assert lines[0].split() == [
        "room",
        "state",
        "outcome",
        "reason",
        "prefill",
        "decode",
        "prompt",
        "out",
        "text",
    ]
    assert str(BIG) in lines[2] and "completed" in lines[2] and "prefill-0" in lines[2]
    assert "line one\\nline two" in lines[2] and lines[2].endswith("...")  # escaped and clipped
    assert lines[3].split()[:4] == ["7", "FAILED", "failed", "peer_lost"]
    assert len(lines) == 4


def test_rooms_passes_state_and_limit(capsys):
    code, _, _, bootstrap = run(
        capsys, ["rooms", "--state", "SUCCESS", "--limit", "3"], {("GET", "/rooms"): (200, [])}
    )
    assert code == 0
    assert dict(bootstrap.requests[0].url.params) == {"state": "SUCCESS", "limit": "3"}


def test_nodes_table(capsys):
    nodes = [
        node(),
        node("decode-0", "decode", healthy=False, problem="a rank lost", draining=True, free_pages=None),
    ]
    code, out, _, _ = run(capsys, ["nodes"], {("GET", "/nodes"): (200, nodes)})
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split("  ")[0] == "node" and "free pages" in lines[0]
    assert lines[0].replace("free pages", "free_pages").replace("heartbeat s", "heartbeat_s").split() == [
        "node",
        "role",
        "tp",
        "alive",
        "health",
        "draining",
        "rooms",
        "free_pages",
        "heartbeat_s",
    ]
    assert lines[2].split() == ["prefill-0", "prefill", "2", "yes", "ok", "no", "1", "60/64", "0.25"]
    assert "a rank lost" in lines[3] and "-/64" in lines[3] and " yes " in lines[3]


@pytest.mark.parametrize(
    ("argv", "answers"),
    [
        (["rooms", "--json"], {("GET", "/rooms"): (200, [room()])}),
        (["nodes", "--json"], {("GET", "/nodes"): (200, [node()])}),
        (["submit", "--prompt", "hi", "--json"], {("POST", "/rooms"): (201, room())}),
        (["wait", str(BIG), "--json"], {("GET", f"/rooms/{BIG}"): (200, room())}),
        (["abort", str(BIG), "--json"], {("DELETE", f"/rooms/{BIG}"): (200, room(state="FAILED"))}),
    ],
)
def test_json_prints_the_answer(capsys, argv, answers):
    code, out, _, _ = run(capsys, argv, answers)
    assert code == 0
    assert json.loads(out) == next(iter(answers.values()))[1]


def test_json_room_id_exact(capsys):
    _, out, _, _ = run(capsys, ["rooms", "--json"], {("GET", "/rooms"): (200, [room()])})
    assert json.loads(out)[0]["room"] == 9007199254740991
    assert '"room": 9007199254740991' in out


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"python -m bootstrap.client {VERSION}"


def test_help_has_plain_metavars(capsys):
    for argv in (["--help"], ["submit", "--help"], ["rooms", "--help"], ["wait", "--help"]):
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        assert exit_.value.code == 0
        out = capsys.readouterr().out
        assert "{" not in out and "null" not in out, out


def test_validation_error_is_one_line(capsys):
    code, out, err, _ = run(capsys, ["rooms", "--state", "BOGUS"], {("GET", "/rooms"): (422, STATE_422)})
    assert code == 1 and out == ""
    assert err.count("\n") == 1
    assert "error 422: state: Input should be 'FAILED', 'BOOTSTRAPPING'" in err


@pytest.mark.parametrize(
    ("status", "body", "said"),
    [
        (409, {"detail": "room 5 already ended FAILED"}, "error 409: room 5 already ended FAILED"),
        (
            401,
            {"error": {"message": "a valid API key is required"}},
            "error 401: a valid API key is required",
        ),
        (502, "<html>\n<b>Bad gateway</b>\n</html>", "error 502: <html> <b>Bad gateway</b> </html>"),
    ],
)
def test_other_errors_are_one_line(capsys, status, body, said):
    code, _, err, _ = run(capsys, ["abort", "5"], {("DELETE", "/rooms/5"): (status, body)})
    assert code == 1 and err.count("\n") == 1 and said in err


def test_wait_unknown_room_fails(capsys):
    code, _, err, _ = run(capsys, ["wait", "12345"])
    assert code == 1 and "error 404" in err


def test_wait_failed_room_exits_1(capsys):
    failed = room(5, "FAILED", reason="aborted")
    code, out, _, _ = run(capsys, ["wait", "5"], {("GET", "/rooms/5"): (200, failed)})
    assert code == 1 and "aborted" in out


def test_submit_waits_for_the_room(capsys):
    answers = {("POST", "/rooms"): (201, room(3, "BOOTSTRAPPING")), ("GET", "/rooms/3"): (200, room(3))}
    code, out, _, bootstrap = run(capsys, ["submit", "--input-ids", "1,2,3", "--wait", "5"], answers)
    assert code == 0 and "SUCCESS" in out
    assert json.loads(bootstrap.requests[0].content) == {"max_new_tokens": 16, "input_ids": [1, 2, 3]}
    assert bootstrap.requests[1].url.path == "/rooms/3"


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["wait", "abc"], "argument ROOM: a room id is an integer, not 'abc'"),
        (["abort", "1.5"], "argument ROOM: a room id is an integer, not '1.5'"),
        (["submit", "--input-ids", "1,x"], "argument --input-ids: expected comma-separated integers"),
        (["rooms", "--limit", "many"], "argument --limit: invalid int value: 'many'"),
        (["--url", "localhost:8000", "nodes"], "argument --url: expected http://HOST:PORT"),
        ([], "the following arguments are required: COMMAND"),
    ],
)
def test_bad_arguments_exit_2_in_one_line(capsys, argv, said):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and said in err, err


def test_api_key_sent_on_every_request(capsys):
    answers = {("POST", "/rooms"): (201, room(3, "BOOTSTRAPPING")), ("GET", "/rooms/3"): (200, room(3))}
    code, _, _, bootstrap = run(
        capsys, ["--api-key", "s3cret", "submit", "--prompt", "hi", "--wait", "5"], answers
    )
    assert code == 0 and len(bootstrap.requests) == 2
    assert all(r.headers["authorization"] == "Bearer s3cret" for r in bootstrap.requests)


def test_api_key_from_environment(capsys, monkeypatch):
    monkeypatch.setenv("KVROOM_API_KEY", "from-env")
    _, _, _, bootstrap = run(capsys, ["nodes"], {("GET", "/nodes"): (200, [])})
    assert bootstrap.requests[0].headers["authorization"] == "Bearer from-env"


def test_no_api_key_no_header(capsys):
    _, _, _, bootstrap = run(capsys, ["nodes"], {("GET", "/nodes"): (200, [])})
    assert "authorization" not in bootstrap.requests[0].headers


def test_unreachable_bootstrap_is_one_line(capsys):
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("[Errno 111] Connection refused", request=request)

    code = main(["--url", "http://127.0.0.1:9", "rooms"], transport=httpx.MockTransport(refuse))
    out, err = capsys.readouterr()
    assert code != 0 and out == ""
    assert err == "python -m bootstrap.client: cannot reach the bootstrap at http://127.0.0.1:9: " + (
        "[Errno 111] Connection refused\n"
    )


def test_unreachable_bootstrap_for_real(capsys):
    code = main(["--url", f"http://127.0.0.1:{free_port()}", "nodes"])
    err = capsys.readouterr().err
    assert code == 1 and err.count("\n") == 1 and "cannot reach the bootstrap" in err
