"""kvdoctor: reproduce and diagnose scheduler-side bugs of vLLM's KV offloading connector."""

__version__ = "0.1.0"
