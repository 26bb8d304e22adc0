"""The wire: typed msgspec messages (messages.py; a step's plan and result in step.py) over ZeroMQ
ipc sockets (channel.py).

Each stage process binds exactly one inbound PULL socket (addresses.py) and decodes it with one
typed decoder for its union; senders connect PUSH sockets to it. No pickle anywhere.
"""
