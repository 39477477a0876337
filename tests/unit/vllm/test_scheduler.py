"""The connector's scheduler half: which requests load, what each step's plan holds, and what the
node reports, with vLLM's requests and outputs as plain objects (no vLLM engine here)."""

import time
from types import SimpleNamespace

import msgspec
import pytest
from vllm.v1.request import RequestStatus

from kvroom_vllm.messages import RankHandshake, WorkerReport
from kvroom_vllm.scheduler import SchedulerHalf
from kvroom_vllm.settings import settings_from
from launcher.local_stack import free_port
from shared.room.states import RoomState
from shared.wire import grants, protocol
from shared.wire.registration import ModelIdentity
from tests.support import until

PEER = protocol.PeerRank(0, "127.0.0.1:1", "tcp://127.0.0.1:2", "", 0, 2)
IDENTITY = ModelIdentity(
    name="tiny",
    architecture="LlamaForCausalLM",
    weights="w",
    tokenizer="t",
    dtype="float32",
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=64,
    vocab_size=512,
    page_size=128,
    engine="vllm 0.32.0",
)


NODE = "vllm-under-test"
KEY = bytes(range(32))  # the cluster's key, as the bootstrap's answers give it


def params(
    transfer: int, role: str, prompt: int = 300, key: bytes = KEY, ttl_s: float = 60.0, **changed
) -> dict:
    """A request's transfer parameters as the bootstrap signs them; ``changed`` fields after signing."""
    tokens = list(range(prompt))  # what request() holds
    grant = grants.TransferGrant(
        transfer,
        role,
        NODE,
        "other",
        [PEER],
        prompt,
        grants.prompt_digest(tokens),
        time.time() + ttl_s,  # type: ignore[arg-type]
    )
    return {"kvroom": {**msgspec.to_builtins(grants.sign(grant, key)), **changed}}


def request(
    req_id: str, kv_transfer_params: dict | None, prompt: int = 300, status=RequestStatus.WAITING
) -> SimpleNamespace:
    return SimpleNamespace(
        request_id=req_id,
        kv_transfer_params=kv_transfer_params,
        prompt_token_ids=list(range(prompt)),
        num_prompt_tokens=prompt,
        output_token_ids=[],
        status=status,
    )


def output(recving=(), sending=(), failed=None, ready=None, invalid=()) -> SimpleNamespace:
    report = WorkerReport(failed or {}, ready=ready or {}) if failed or ready else None
    return SimpleNamespace(
        finished_recving=set(recving),
        finished_sending=set(sending),
        failed_recving=set(),
        invalid_block_ids=set(invalid),
        kv_connector_worker_meta=report,
    )


@pytest.fixture
def half(request):
    role = request.param
    # The node's bootstrap is not there: it keeps trying, and reports wait; rooms are still kept.
    settings = settings_from(
        {
            "http_url": "http://127.0.0.1:8100",
            "zmq_port": 9100,
            "zmq_security": "plain",
            "node_id": NODE,
            "bootstrap_url": f"http://127.0.0.1:{free_port()}",
        }
    )
    h = SchedulerHalf(IDENTITY, settings, role, 4096)
    h.start({0: RankHandshake(msgspec.to_builtins(PEER), 4096)})
    h.membership.params_key = KEY
    yield h
    h.close()


def state(half: SchedulerHalf, transfer: int) -> RoomState | None:
    room = half.rooms.find(protocol.TransferId(transfer))
    return room.state if room is not None else None


@pytest.mark.parametrize("half", ["decode"], indirect=True)
def test_a_decode_room_loads_its_whole_prompt_once_and_is_success_only_when_every_worker_finished(half):
    plain, room = request("plain", None), request("r1", params(11, "decode"))
    assert half.matched_tokens(plain, 0) == (0, False)
    assert half.matched_tokens(room, 128) == (300 - 128, True)
    half.allocated(room, [7, 8], 172)
    half.allocated(room, [7, 8, 9], 0)  # vLLM's second call, after the load: nothing more
    assert half.matched_tokens(room, 128) == (0, False)
    plan = half.step_plan()
    assert [(load.req_id, load.blocks, load.prompt_len) for load in plan.loads] == [("r1", [7, 8], 300)]
    assert half.step_plan().loads == []
    until(lambda: state(half, 11) is RoomState.BOOTSTRAPPING)
    half.took_output(output())
    assert state(half, 11) is RoomState.BOOTSTRAPPING
    half.took_output(output(recving={"r1"}))
    until(lambda: state(half, 11) is RoomState.SUCCESS)
    assert half.finished(room, [7, 8, 9]) is False
    assert "r1" not in half._requests


@pytest.mark.parametrize("half", ["decode"], indirect=True)
def test_a_decode_room_that_failed_on_one_worker_is_failed_at_once_with_its_reason(half):
    """The first worker's failure fails the room, before every worker finished the load (vLLM keeps
    its blocks until then)."""
    room = request("r1", params(21, "decode"))
    half.allocated(room, [1], 300)
    half.took_output(output(failed={"r1": "aux_timeout"}))  # one worker; the others not yet
    until(lambda: state(half, 21) is RoomState.FAILED)
    half.took_output(output(failed={"r1": "aborted"}))  # a later worker's, once its load was stopped
    half.took_output(output(recving={"r1"}))  # vLLM's sum: every worker finished the load
    assert half.rooms.find(protocol.TransferId(21)).reason == "aux_timeout"
    assert half._failures == {}


@pytest.mark.parametrize("half", ["decode"], indirect=True)
def test_a_decode_request_that_ends_early_stops_its_load_or_frees_its_writers(half):
    loading, unplaced = request("r1", params(31, "decode")), request("r2", params(32, "decode"))
    half.allocated(loading, [1], 300)
    half.step_plan()
    assert half.finished(loading, [1]) is False  # vLLM itself keeps blocks it is loading into
    assert half.finished(unplaced, []) is False
    plan = half.step_plan()
    assert plan.stopped_loads == ["r1"]
    assert [room.transfer for room in plan.revoked] == [32]
    half.took_output(output(recving={"r1"}, failed={"r1": "aborted"}))
    assert half._requests == {}  # nothing kept once the stopped load settled


@pytest.mark.parametrize("half", ["prefill"], indirect=True)
def test_a_prefill_keeps_a_computed_prompts_blocks_until_its_workers_sent_them(half):
    done = request("p1", params(41, "prefill"), status=RequestStatus.FINISHED_LENGTH_CAPPED)
    done.output_token_ids = [99]
    aborted = request("p2", params(42, "prefill"), status=RequestStatus.FINISHED_ABORTED)
    assert half.matched_tokens(done, 0) == (0, False)  # a prefill loads nothing
    half.allocated(done, [3, 4, 5], 0)
    assert [r.transfer for r in half.step_plan().scheduled] == [41]  # a revoke can be answered now
    assert half.finished(done, [3, 4, 5]) is True
    assert half.finished(aborted, [6]) is False
    plan = half.step_plan()
    (send,) = plan.sends
    assert (send.req_id, send.blocks, send.prompt_len, send.first_token) == ("p1", [3, 4, 5], 300, 99)
    assert [r.transfer for r in plan.unsent] == [42]  # its decode hears at once: nothing comes
    half.took_output(output(sending={"p1"}))
    assert half._requests == {}


@pytest.mark.parametrize("half", ["decode"], indirect=True)
@pytest.mark.parametrize("same_step", [True, False], ids=["one-step", "two-steps"])
def test_workers_ready_with_different_records_fail_the_load_aux_mismatch(half, same_step):
    """No worker names the blocks as failed (each found its own record intact): the load is held
    back from vLLM, and the next step's workers fail it, so vLLM never decodes from that KV."""
    room = request("r1", params(23, "decode"))
    half.allocated(room, [1, 4], 300)
    half.step_plan()
    first, second = WorkerReport(ready={"r1": 0xAAAA}), WorkerReport(ready={"r1": 0xBBBB})
    if same_step:  # vLLM folds the workers' reports of one step, the first worker's first
        finished = SimpleNamespace(
            **{**vars(output(recving={"r1"})), "kv_connector_worker_meta": first.aggregate(second)}
        )
    else:
        half.took_output(output(ready=first.ready))
        finished = output(recving={"r1"}, ready=second.ready)
    half.took_output(finished)
    assert finished.finished_recving == set()  # vLLM does not take it as loaded
    assert half.step_plan().refused == {"r1": [1, 4]}  # the workers fail its load and its blocks
    assert state(half, 23) is not RoomState.FAILED  # not yet: its blocks are not failed yet
    half.took_output(output(recving={"r1"}, invalid={1, 4}))
    until(lambda: state(half, 23) is RoomState.FAILED)
    assert half.rooms.find(protocol.TransferId(23)).reason == "aux_mismatch"


@pytest.mark.parametrize("half", ["decode"], indirect=True)
def test_workers_ready_with_one_record_succeed(half):
    room = request("r1", params(24, "decode"))
    half.allocated(room, [1], 300)
    half.took_output(output(recving={"r1"}, ready={"r1": 7}))
    until(lambda: state(half, 24) is RoomState.SUCCESS)


FORGED = {
    "unsigned": params(51, "decode", signature=""),
    "another key": params(51, "decode", key=bytes(32)),
    "peers changed": params(51, "decode", peers=[msgspec.to_builtins(PEER)] * 2),
    "transfer changed": {"kvroom": {**params(52, "decode")["kvroom"], "transfer": 51}},
    "expired": params(51, "decode", ttl_s=-1.0),
    "for a prefill": params(51, "prefill"),
    "another prompt": params(51, "decode", prompt=299),
    "same length, other tokens": params(51, "decode", prompt_digest=grants.prompt_digest([7] * 300)),
    "for another server": params(51, "decode", node="vllm-elsewhere"),
    "not an object": "kvroom",
    "not a grant": {"kvroom": {"transfer": 51}},
}


@pytest.mark.parametrize("half", ["decode"], indirect=True)
@pytest.mark.parametrize("kvroom", FORGED.values(), ids=FORGED.keys())
def test_a_request_whose_parameters_the_bootstrap_did_not_issue_fails_as_a_load_and_is_no_room(half, kvroom):
    forged = request("f1", kvroom)
    # It "loads" its whole prompt, so that it fails before anything is computed, not served plain.
    assert half.matched_tokens(forged, 0) == (300, True)
    half.allocated(forged, [4, 5], 300)
    plan = half.step_plan()
    assert plan.refused == {"f1": [4, 5]} and plan.loads == [] and plan.scheduled == []
    half.took_output(output(recving={"f1"}))
    assert half.finished(forged, [4, 5]) is False
    plan = half.step_plan()
    assert plan.revoked == [] and plan.stopped_loads == []  # no peer hears of it
    assert half.rooms.find(protocol.TransferId(51)) is None
    assert half._refused == set() and half._granted == {}


@pytest.mark.parametrize("half", ["decode"], indirect=True)
def test_a_grant_replayed_by_a_second_request_is_refused_and_the_first_room_goes_on(half):
    grant = params(61, "decode")
    first, replay = request("r1", grant), request("r2", grant)
    assert half.matched_tokens(first, 0) == (300, True)
    half.allocated(first, [1], 300)
    assert half.matched_tokens(replay, 0) == (300, True)
    half.allocated(replay, [2], 300)
    assert half.finished(replay, [2]) is False  # ending the replay revokes nothing of the room
    plan = half.step_plan()
    assert [load.req_id for load in plan.loads] == ["r1"] and plan.refused == {"r2": [2]}
    assert plan.revoked == [] and plan.stopped_loads == []
    half.took_output(output(recving={"r1"}))
    until(lambda: state(half, 61) is RoomState.SUCCESS)


@pytest.mark.parametrize("half", ["prefill"], indirect=True)
def test_a_prefill_request_with_forged_parameters_is_never_computed_or_sent(half):
    forged = request("p1", params(71, "prefill", key=bytes(32)), status=RequestStatus.FINISHED_LENGTH_CAPPED)
    forged.output_token_ids = [99]
    assert half.matched_tokens(forged, 0) == (300, True)
    half.allocated(forged, [3], 300)
    assert half.finished(forged, [3]) is False
    plan = half.step_plan()
    assert plan.refused == {"p1": [3]} and plan.sends == [] and plan.scheduled == [] and plan.unsent == []


@pytest.mark.parametrize("half", ["decode"], indirect=True)
def test_writers_the_bootstraps_heartbeat_answer_names_gone_reach_the_workers_in_the_next_plan(half):
    answer = {
        "node_id": NODE,
        "bootstraps": [{"id": "b0", "report_endpoint": f"tcp://127.0.0.1:{free_port()}", "public_key": ""}],
        "node_ttl_s": 10.0,
        "epoch": "e0",
        "writers_gone": [7, 9],
    }
    half._loop.call_soon_threadsafe(half.membership._accept, answer)  # on the node's thread
    plans = []
    until(lambda: plans.append(half.step_plan()) or any(p.writers_gone for p in plans))
    assert [t for p in plans for t in p.writers_gone] == [7, 9]
    assert half.step_plan().writers_gone == []  # once


@pytest.mark.parametrize("half", ["prefill"], indirect=True)
def test_a_prefill_leaves_only_once_no_write_of_a_worker_in_its_process_may_move(half, monkeypatch):
    moving = True
    monkeypatch.setattr("kvroom_vllm.scheduler.writes_may_move", lambda: moving)
    assert not half._writes_over()
    moving = False
    monkeypatch.setattr(half.settings, "transport", "rdma")  # no kernel to ask
    assert half._writes_over()
