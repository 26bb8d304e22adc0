"""conveyor: a process-per-stage LLM inference server. The front door: the Python API."""
