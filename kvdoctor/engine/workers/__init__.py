"""Workers behind the harness's seam: simulated bookkeeping, or vLLM's real worker side."""
