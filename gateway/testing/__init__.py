"""Test helpers shipped with the package, for the project's tests, its benchmarks and users' own
tests: fake engines and encoders (`fakes`), a gateway over them with its clients and, on request,
its logs and spans (`fake_gateway`), a fake upstream (`upstream_fake`), a real vLLM server from
its own venv (`vllm_server`), real gateway processes on loopback ports (`processes`), an OTLP
receiver (`otlp_receiver`), free ports (`ports`), sample
photos and data URLs (`images`), engine requests and their answers (`engine_requests`), a raw
Realtime peer and frame readers (`realtime_peer`), polling waits (`waiting`), and a clock that
moves only when told (`clock`).
"""
