"""What a request's fields become before the engine (no server: tests/test_serve_requests.py
sends the same shapes to the real one): the checks' answers for fields that ask for nothing, and
the per-request sampling values the engine gets."""
import pytest
import transformers
from transformers import GenerationConfig

needs_engine = pytest.mark.skipif(not hasattr(transformers, "ContinuousBatchingConfig"), reason=(
    f"transformers {transformers.__version__} has no continuous batching engine to serve"))
pytestmark = needs_engine

HELLO = [{"role": "user", "content": "hi"}]


def test_fields_that_ask_for_nothing_pass_and_their_sampling_comes_back():
    from kvcache_ext.serving.validation import Sampling, check_request
    body = {"messages": HELLO, "n": 1, "stop": None, "seed": None, "logprobs": False, "frequency_penalty": 0,
            "stream_options": {"include_usage": True}, "user": "u1", "temperature": 0.7, "top_k": 5}
    assert check_request("chat", body) == Sampling(temperature=0.7, top_p=None, top_k=5)
    assert check_request("completion", {"prompt": "hi", "top_p": 1}) == Sampling(top_p=1)
    parts = [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]}]
    assert check_request("response", {"input": parts, "max_output_tokens": 3}) == Sampling()


@pytest.mark.parametrize("body, param, code", [
    ({"messages": HELLO, "n": 2}, "n", "unsupported_value"),
    ({"messages": HELLO, "logprobs": True}, "logprobs", "unsupported_value"),
    ({"messages": HELLO, "max_tokens": True}, "max_tokens", "invalid_value"),  # a bool is not a count
    ({"messages": HELLO, "stream_options": {"x": 1}}, "stream_options", "invalid_value"),
    ({"messages": HELLO, "audio": {}}, "audio", "unsupported_field"),
    ({"messages": [{"role": "user"}]}, "messages[0].content", "invalid_value"),
    ({"messages": None}, "messages", "missing_field"),
])
def test_a_bad_field_is_named_with_its_code(body, param, code):
    from kvcache_ext.serving.validation import InvalidRequest, check_request
    with pytest.raises(InvalidRequest) as refused:
        check_request("chat", body)
    assert (refused.value.param, refused.value.code, refused.value.status) == (param, code, 400)
    assert refused.value.body() == {"error": {"message": str(refused.value), "type": "invalid_request_error",
                                              "param": param, "code": code}}


def test_each_request_passes_the_engine_its_own_values():
    from kvcache_ext.serving.sampling import GREEDY, NO_TOP_K, engine_kwargs
    from kvcache_ext.serving.validation import Sampling
    greedy_model = GenerationConfig()
    sampling_model = GenerationConfig(do_sample=True, temperature=0.6, top_p=0.9, top_k=20)
    assert engine_kwargs(Sampling(), greedy_model) == GREEDY
    assert engine_kwargs(Sampling(temperature=0), sampling_model) == GREEDY
    assert engine_kwargs(Sampling(temperature=1e-6), greedy_model) == GREEDY     # its limit: no overflow
    assert engine_kwargs(Sampling(temperature=1.3), greedy_model) == {"temperature": 1.3, "top_k": NO_TOP_K,
                                                                      "top_p": 1.0}
    assert engine_kwargs(Sampling(top_p=0.5), greedy_model) == {"temperature": 1.0, "top_k": NO_TOP_K, "top_p": 0.5}
    assert engine_kwargs(Sampling(), sampling_model) == {"temperature": 0.6, "top_k": 20, "top_p": 0.9}
    assert engine_kwargs(Sampling(top_k=3), sampling_model) == {"temperature": 0.6, "top_k": 3, "top_p": 0.9}
