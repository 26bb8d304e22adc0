"""The router stage (data parallelism): picks each request's engine by prefix-cache affinity and
load. policy.py is pure Python (no zmq), also used by the HTTP replica router; requests.py keeps
the books on what went where; main.py is the process loop that owns the sockets."""
