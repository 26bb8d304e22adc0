"""The router stage (data parallelism): picks each request's engine by prefix-cache affinity and
load. policy.py is pure Python (no zmq), also used by the HTTP replica router; main.py is the
process loop that owns the sockets."""
