"""When a worker's rank gets the step's plan: vLLM binds it before the forward and calls
``start_load_kv`` after the forward is launched, which on a CPU is after it has run. A prompt's
send (and a load into a KV cache in host memory) must not wait a whole forward."""

from dataclasses import dataclass, field

import pytest

from kvroom_vllm.connector import KvroomConnector
from kvroom_vllm.messages import Load, Send, StepPlan, TransferGrant
from shared.wire import protocol

ROOM = TransferGrant(protocol.TransferId(5), "decode", "me", "other", [], 8, "0" * 64, expires=0.0)


@dataclass
class KvPlace:
    on_host: bool


@dataclass
class RecordingRank:
    """The worker half as the connector sees it: what it was handed, in order."""

    kv: KvPlace
    handed: list[StepPlan] = field(default_factory=list)

    def take_plan(self, plan: StepPlan) -> None:
        self.handed.append(plan)


def connector(on_host: bool) -> tuple[KvroomConnector, RecordingRank]:
    made = KvroomConnector.__new__(KvroomConnector)  # the worker side only, without a vLLM config
    rank = RecordingRank(KvPlace(on_host))
    made._worker = rank  # type: ignore[assignment]
    return made, rank


def plan() -> StepPlan:
    return StepPlan(
        loads=[Load("d", ROOM, [1, 2], 20)],
        sends=[Send("p", ROOM, [3, 4], 20, 7)],
        stopped_loads=["x"],
        revoked=[ROOM],
    )


def test_a_kv_cache_in_host_memory_gets_the_whole_plan_before_the_forward():
    conn, rank = connector(on_host=True)
    conn.bind_connector_metadata(plan())
    assert rank.handed == [plan()]
    conn.start_load_kv(None)
    assert rank.handed == [plan()]


@pytest.mark.parametrize("step", [plan(), StepPlan()])
def test_on_a_gpu_loads_wait_for_the_forward_launch_and_the_rest_goes_before(step):
    conn, rank = connector(on_host=False)
    conn.bind_connector_metadata(step)
    assert rank.handed == [StepPlan(sends=step.sends, stopped_loads=step.stopped_loads, revoked=step.revoked)]
    conn.start_load_kv(None)
    assert rank.handed[1:] == [StepPlan(loads=step.loads)]
