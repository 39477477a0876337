"""Bad client input against a real stack: a typed 4xx at once, OpenAI-shaped under /v1, and nothing lost.

Each request is refused before a room is placed: no node hears of it, so none
can look lost and no room fails for it. The bootstrap logs no traceback for any
of them, and afterwards the nodes are healthy, their pools full, and a good
request is served.
"""

import json

from shared.models.reference import encode_text, generate
from tests.integration.helpers import pools_full

DEEP = "[" * 100_000 + "]" * 100_000
TOO_LARGE = json.dumps({"prompt": "x" * (2 << 20)})
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"


def completion(**fields):
    return json.dumps({"model": "reference", "prompt": "hello", **fields})


def chat(content="hello", **fields):
    return json.dumps({"model": "reference", "messages": [{"role": "user", "content": content}], **fields})


# (path, body, status, the parameter named: under /v1 in the error, on /rooms in the detail)
CASES = [
    ("/rooms", '{"prompt": "\\ud800"}', 422, "prompt"),
    ("/rooms", DEEP, 400, None),
    ("/rooms", '{"prompt": ' + DEEP + "}", 400, None),
    ("/rooms", '{"prompt": ""}', 422, "prompt"),
    ("/rooms", '{"input_ids": []}', 422, "input_ids"),
    ("/rooms", '{"prompt": "hi", "max_new_tokens": "5"}', 422, "max_new_tokens"),
    ("/rooms", '{"prompt": "hi", "max_new_tokens": 0}', 422, "max_new_tokens"),
    ("/rooms", '{"input_ids": [300]}', 422, "input_ids"),
    ("/rooms", '{"prompt": "hi"', 422, None),
    ("/rooms", TOO_LARGE, 413, None),
    (COMPLETIONS, '{"model": "reference", "prompt": "\\ud800"}', 400, "prompt"),
    (COMPLETIONS, '{"model": "\\ud800", "prompt": "hi"}', 400, "model"),
    (CHAT, '{"model": "\\ud800", "messages": [{"role": "user", "content": "hi"}]}', 400, "model"),
    (COMPLETIONS, DEEP, 400, None),
    (COMPLETIONS, '{"model": "reference", "prompt": ' + DEEP + "}", 400, None),
    (COMPLETIONS, completion(prompt=""), 400, "prompt"),
    (COMPLETIONS, completion(prompt=[]), 400, "prompt"),
    (COMPLETIONS, completion(prompt=[256]), 400, "prompt"),
    (COMPLETIONS, completion(stop="x" * 300), 400, "stop"),
    (COMPLETIONS, completion(stop=""), 400, "stop"),
    (COMPLETIONS, completion(stop=["a", ""]), 400, "stop"),
    (COMPLETIONS, completion(stop=["a", "b", "c", "d", "e"]), 400, "stop"),
    (COMPLETIONS, completion(max_tokens="5"), 400, "max_tokens"),
    (COMPLETIONS, completion(max_tokens=0), 400, "max_tokens"),
    (COMPLETIONS, completion(max_tokens=10**6), 400, "max_tokens"),
    (COMPLETIONS, completion(stream="true"), 400, "stream"),
    (COMPLETIONS, '{"model": "reference", "prompt":', 400, None),
    (COMPLETIONS, TOO_LARGE, 413, None),
    (CHAT, '{"model": "reference", "messages": [{"role": "user", "content": "\\ud800"}]}', 400, "messages"),
    (CHAT, DEEP, 400, None),
    (CHAT, chat(), 400, "messages"),  # the reference model has no chat template
    (CHAT, json.dumps({"model": "reference", "messages": []}), 400, "messages"),
    (CHAT, chat(stop="x" * 300), 400, "stop"),
    (CHAT, chat(stop=""), 400, "stop"),
    (CHAT, chat(max_tokens="5"), 400, "max_tokens"),
    (CHAT, '{"model": "reference", "messages": ', 400, None),
    (CHAT, TOO_LARGE, 413, None),
]


def test_bad_input_is_refused_at_once_and_loses_nothing(stack, model):
    prefill, decode = stack.start()
    with stack.client() as client:
        for path, body, status, param in CASES:
            resp = client.post(path, content=body, headers={"content-type": "application/json"})
            what = f"{path} {body[:60]!r}"
            assert resp.status_code == status, (what, resp.text[:300])
            answer = resp.json()
            if path.startswith("/v1/"):
                error = answer["error"]
                assert set(error) == {"message", "type", "param", "code"}, (what, answer)
                assert error["type"] == "invalid_request_error" and error["message"], (what, answer)
                assert error["param"] == param or (error["param"] or "").startswith(f"{param}."), what
            else:
                assert "detail" in answer, (what, answer)
                if param is not None:
                    assert param in json.dumps(answer["detail"]), (what, answer)
        for path in ("/rooms", COMPLETIONS):  # a body over the limit with no length declared
            resp = client.post(
                path, content=iter([TOO_LARGE.encode()]), headers={"content-type": "application/json"}
            )
            assert resp.status_code == 413, (path, resp.text[:200])
            assert ("error" in resp.json()) == path.startswith("/v1/")
        assert client.get("/rooms").json() == []  # no room was placed for any of them
        good = client.post(COMPLETIONS, json={"model": "reference", "prompt": "still here", "max_tokens": 4})
        assert good.status_code == 200, good.text
    expected = generate(model, encode_text("still here"), 4)
    assert good.json()["choices"][0]["text"] == bytes(expected).decode("utf-8", errors="replace")
    assert prefill.health()["status"] == decode.health()["status"] == "ok"
    assert pools_full(prefill, decode)
    for service in stack.services:
        log = service.log_path.read_text(errors="replace")
        assert "Traceback" not in log, f"{service.name} logged a traceback:\n{service.log_tail(60)}"
