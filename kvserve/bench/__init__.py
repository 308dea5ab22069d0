"""Benchmarks: ``kvserve bench serve`` (load-test an OpenAI-compatible server)."""

from kvserve.bench.serve import add_parser, run

__all__ = ["add_parser", "run"]
