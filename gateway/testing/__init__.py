"""Test helpers shipped with the package, for the project's tests, its benchmarks and users' own
tests: fake engines and encoders, a fake upstream, real gateway processes on loopback ports, an
OTLP receiver and free ports.
"""
