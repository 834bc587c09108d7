"""The engine driver (LLMEngine) on tiny models: outputs reach the sink of their caller, an abort
forgets a request everywhere, and a failed step fails only the callers of its requests while the
engine goes on."""

from __future__ import annotations

import pytest

from tidepool.engine.args import build_engine_config
from tidepool.engine.generation_stream import GenerationInput
from tidepool.engine.input_processor import InputProcessor
from tidepool.engine.llm_engine import EngineStepError, LLMEngine
from tidepool.outputs import PoolingRequestOutput, RequestOutput
from tidepool.params import PoolingParams, SamplingParams
from tidepool.request import Request


class Sink:
    """Records what the driver hands one caller."""

    def __init__(self) -> None:
        self.outputs: list = []
        self.num_flushes = 0
        self.errors: list[BaseException] = []

    def add_output(self, out) -> None:
        self.outputs.append(out)

    def flush(self) -> None:
        self.num_flushes += 1

    def fail(self, exc: BaseException) -> None:
        self.errors.append(exc)


@pytest.fixture(scope="module")
def encoder(tiny_model_path) -> tuple[LLMEngine, InputProcessor]:
    # Two sequences a step: which requests share a step is known.
    config = build_engine_config(
        str(tiny_model_path("bert")), device="cpu", dtype="float32", max_num_seqs=2
    )
    processor = InputProcessor(config.model)
    return LLMEngine(config, processor.tokenizer), processor


@pytest.fixture(scope="module")
def decoder(tiny_decoder_path) -> tuple[LLMEngine, InputProcessor]:
    config = build_engine_config(str(tiny_decoder_path("llama")), device="cpu", dtype="float32")
    processor = InputProcessor(config.model)
    return LLMEngine(config, processor.tokenizer), processor


def _pooling(processor: InputProcessor, texts: list[str]) -> list[Request]:
    requests = processor.process(texts, [PoolingParams(task="embed")] * len(texts))
    assert all(isinstance(r, Request) for r in requests)
    return requests  # type: ignore[return-value]


def _run(engine: LLMEngine, max_steps: int = 100) -> None:
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return
        engine.step()
    raise AssertionError("the engine did not finish")


def test_pooled_outputs_reach_their_callers(encoder) -> None:
    engine, processor = encoder
    first, second = Sink(), Sink()
    requests = _pooling(processor, [f"text number {i}" for i in range(5)])
    for request, sink in zip(requests, [first, second, first, second, second], strict=True):
        engine.add_request(request, sink)
    _run(engine)
    ids = [r.request_id for r in requests]
    assert [o.request_id for o in first.outputs] == [ids[0], ids[2]]
    assert [o.request_id for o in second.outputs] == [ids[1], ids[3], ids[4]]
    assert all(isinstance(o, PoolingRequestOutput) and o.finished for o in first.outputs)
    assert first.outputs[0].outputs.data.shape == second.outputs[0].outputs.data.shape
    assert not first.errors and not second.errors
    # Steps of two: (0, 1), (2, 3), (4): one flush per step that gave the sink outputs.
    assert (first.num_flushes, second.num_flushes) == (2, 3)


def test_abort_forgets_the_request(encoder) -> None:
    engine, processor = encoder
    sink = Sink()
    requests = _pooling(processor, ["kept", "aborted", "kept too"])
    for request in requests:
        engine.add_request(request, sink)
    assert engine.abort_request(requests[1].request_id)
    assert not engine.abort_request(requests[1].request_id)  # already gone
    assert engine.num_unfinished_requests == 2
    _run(engine)
    assert {o.request_id for o in sink.outputs} == {requests[0].request_id, requests[2].request_id}
    assert not engine.core.has_unfinished_requests()


def test_failed_step_fails_only_its_callers(encoder, monkeypatch) -> None:
    engine, processor = encoder
    runner = engine.core.model_runner
    execute = runner.execute
    num_calls = 0

    def fail_first_step(sched_out):
        nonlocal num_calls
        num_calls += 1
        if num_calls == 1:
            raise RuntimeError("injected failure")
        return execute(sched_out)

    monkeypatch.setattr(runner, "execute", fail_first_step)
    failing, other = Sink(), Sink()
    requests = _pooling(processor, [f"request {i}" for i in range(5)])
    # Step 1 runs requests 0 and 1 (the failing caller's); its request 4 is aborted with them.
    for request, sink in zip(requests, [failing, failing, other, other, failing], strict=True):
        engine.add_request(request, sink)
    assert engine.step().failed
    assert len(failing.errors) == 1 and isinstance(failing.errors[0], EngineStepError)
    assert "injected failure" in str(failing.errors[0])
    assert isinstance(failing.errors[0].__cause__, RuntimeError)
    assert engine.num_unfinished_requests == 2  # the other caller's requests wait
    _run(engine)
    assert not failing.outputs and not other.errors
    assert [o.request_id for o in other.outputs] == [requests[2].request_id, requests[3].request_id]
    later = Sink()  # the engine keeps serving
    engine.add_request(_pooling(processor, ["after the failure"])[0], later)
    _run(engine)
    assert len(later.outputs) == 1 and not later.errors
    assert not engine.core.has_unfinished_requests()


def test_refused_request_adds_nothing(encoder) -> None:
    engine, processor = encoder
    bad = processor.process(["x"], [PoolingParams(task="embed", dimensions=100_000)])[0]
    with pytest.raises(ValueError):
        engine.add_request(bad, Sink())  # type: ignore[arg-type]
    assert not engine.has_unfinished_requests() and not engine.core.has_unfinished_requests()
    good = _pooling(processor, ["y"])
    outputs, rejected = engine.run_batch([bad, *good])  # type: ignore[list-item]
    assert outputs[0] is None and rejected[0] is not None and rejected[1] is None
    assert isinstance(outputs[1], PoolingRequestOutput)


def test_generated_outputs_stream_or_finish_per_caller(decoder) -> None:
    engine, processor = decoder
    params = SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.0)
    requests = processor.process_generate(["hello there", "another prompt"], [params] * 2, (2,))
    streamed, final = Sink(), Sink()
    engine.add_request(requests[0], streamed, prompt="hello there", index=3, stream=True)  # type: ignore[arg-type]
    engine.add_request(requests[1], final, prompt="another prompt")  # type: ignore[arg-type]
    _run(engine)
    assert all(isinstance(o, RequestOutput) for o in streamed.outputs + final.outputs)
    assert [o.finished for o in final.outputs] == [True]
    assert len(final.outputs[0].outputs[0].token_ids) == 6
    assert final.outputs[0].prompt == "another prompt"
    assert len(streamed.outputs) > 1 and [o.finished for o in streamed.outputs][-1]
    assert not any(o.finished for o in streamed.outputs[:-1])
    assert sum(len(o.outputs[0].token_ids) for o in streamed.outputs) == 6
    assert {o.outputs[0].index for o in streamed.outputs} == {3}
    # Offline: the same request, not streamed, gives the deltas' concatenation.
    again = processor.process_generate(["hello there"], [params], (2,))[0]
    [out], _ = engine.run_batch([GenerationInput(again, "hello there", 3)])  # type: ignore[arg-type]
    assert out.outputs[0].text == "".join(o.outputs[0].text for o in streamed.outputs)
